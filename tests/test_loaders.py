"""Fitting a post to a prompt budget (loaders.fit_prompt)."""
import loaders


def test_a_cut_keeps_whole_paragraphs_then_sentences_by_hand(tokenizer):
    post = {"subreddit": "test", "title": "A title", "post": "One two three.\n\nFour five six. "
            "Seven eight nine.", "summary": ""}
    render = lambda body: loaders.format_prompt("test", "A title", body)  # noqa: E731
    sizes = {body: len(tokenizer(render(body)).input_ids)
             for body in (post["post"], "One two three.", "One two three.\n\nFour five six.")}
    assert loaders.fit_prompt(tokenizer, post, sizes[post["post"]]) == render(post["post"])
    assert loaders.fit_prompt(tokenizer, post, sizes[post["post"]] - 1) == render("One two three.")
    assert loaders.fit_prompt(tokenizer, post, 3) is None
