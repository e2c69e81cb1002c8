"""Sampling the summaries with a static KV cache: the post's `generate`, at fixed shapes.

The post's `generate` (section "Generating and scoring") calls Hugging Face's
`model.generate(do_sample=True, top_k=TOP_K, top_p=TOP_P, temperature=TEMPERATURE)`. That
loop spends each new token in Python: a growing cache, masks and position ids rebuilt, the
logits processors, then about 1,400 kernels launched one by one (SmolLM2's 30 layers with the
adapter; 1,900 under bf16 autocast, which casts every weight): 30-40 ms a token on an H200.
`sample` draws the same tokens from the same distribution with every tensor at a fixed shape,
so that on CUDA one decoding step is recorded once as a CUDA graph and replayed for every new
token, its kernels launched together (`ppo.generate` picks it: --decoding).

    prefill   one pass over the left-padded prompts, (B, W): keys and values into the cache
    step      one token per row: a_{t-1} in at cache column W + t - 1, a_t out, t = 1 .. T-1

The sampler is the post's and Hugging Face's, for each row and step t:
    z = logits(s_t) / tau                         fp32, tau the temperature
    top-k: z_i = -inf where z_i < the k-th largest z (ties with the k-th stay)
    top-p: sort z ascending; drop the tokens whose cumulative softmax is <= 1 - p; the most
           likely always stays                     (TopKLogitsWarper, TopPLogitsWarper)
    pi = softmax(z);  a_t = argmax_i pi_i / q_i,  q_i ~ Exp(1)
The last line is `torch.multinomial(pi, 1)` as ATen computes it (aten/src/ATen/native/
Distributions.cpp: `q = empty_like(p).exponential_(1)`, `argmax(p / q)`, the Gumbel-max
trick). Drawing q ourselves, into a buffer, before each step (one kernel, outside the graph),
keeps the random stream exactly the one `generate` draws: on the CPU this loop samples Hugging
Face's ids for a seed (up to the last bits of the logits: tests/test_decoding.py), and the
graph needs no random generator registered with it.
A row that has drawn EOS gets EOS from then on (Hugging Face's `next * unfinished + pad * (1 -
unfinished)`, with pad = EOS as ppo.py passes it), and the loop stops once every row has one.

Choices, and why:
    1. The Llama layers are run here (`forward`, about 20 lines: embed, then per layer the
       norm, q/k/v called as the modules so that the LoRA adapter applies, RoPE from the
       model's rotary embedding, grouped-query attention over the cache, o_proj, the MLP; the
       final norm), not transformers' StaticCache behind `model.forward`: that forward builds
       its masks and cache bookkeeping in Python on each call, and its arguments moved between
       the versions we run (5.17, 5.24). Here every step is the same kernels on the same
       buffers, with no `.item()` and no shape that moves, which is what a graph needs.
    2. The graph reads the live tensors: the adapter the optimizer updates in place between
       iterations is the one each replay multiplies by. Autocast's cache of bf16 weight copies
       is off while recording (a copy cast before the recording would be read ever after).
    3. One graph per model, kept while the model lives (a weak reference: freed with the
       policy), recorded again when the shape, the sampler's settings or the address of a
       weight change (a module swapped: the graph would read the old one). The graph's
       prompt columns are padded on the left up to --prompt-tokens, so that one graph serves
       every iteration (P, the batch's longest prompt, moves from one to the next; the extra
       columns are padding, masked, and cost a little attention). Where the step cannot be
       recorded (a driver or a torch that refuses it), one line says so and the same loop
       runs without the graph.
    4. One host sync a step, `unfinished.any()`, to stop where `generate` stops (same T, the
       same number of draws from the random stream); with the graph it costs the launch of
       the next replay.

Departures from Hugging Face's `generate`, each repeated at its line:
    1. The logits come from the LM head in fp32 even under bf16 autocast (departure 3 of
       ppo.py: the log-probs are fp32 too); `generate` samples from bf16 logits there.
    2. Attention runs over the whole cache, masked, rather than over the columns filled so
       far, through torch's attention rather than transformers': the same softmax, summed in
       another order. The logits agree with Hugging Face's to about 2e-6 of their range (fp32
       SmolLM2: 8e-5 on logits up to 39), so a draw could differ only where two tokens tie
       to that precision (none did in 2,304 draws of SmolLM2, 8 posts x 48 tokens x 6 seeds).

Run:   python -m tools.bench_generate --decoding        (ms a new token, HF against this)
Test:  pytest tests/test_decoding.py
"""

import weakref

import torch
import torch.nn.functional as F

import loaders


# --------------------------------------------------------------- the sampler, as HF's

def filtered_probs(logits, temperature, top_k, top_p):
    """pi(. | s_t) as `generate` samples it: temperature, top-k, top-p, softmax.

    in:  logits (B, V) fp32; out: probs (B, V) fp32, 0 on the tokens filtered out.
    The same operations as transformers' TemperatureLogitsWarper, TopKLogitsWarper and
    TopPLogitsWarper, in their order, so that ties and the boundary fall the same way.
    top_k 0 or top_p 1 turn a filter off, as in `generate`.
    """
    # z = logits / tau      (every log-prob divides by it too: ppo.py's departure 3)
    scores = logits / temperature                                   # (B, V)
    if top_k:
        # keep the k largest, and every token tied with the k-th
        kth = scores.topk(min(top_k, scores.shape[-1])).values[:, -1:]             # (B, 1)
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p < 1:
        # nucleus: from the least likely up, drop tokens while their mass is <= 1 - p
        ascending, order = scores.sort(descending=False)            # (B, V) each
        mass = ascending.softmax(-1).cumsum(-1)                     # (B, V) cumulative pi
        drop = mass <= 1 - top_p                                    # (B, V) in sorted order
        drop[:, -1] = False                                         # the most likely stays
        drop = drop.scatter(1, order, drop)                         # (B, V) vocabulary order
        scores = scores.masked_fill(drop, -float("inf"))
    return scores.softmax(-1)                                       # (B, V)


# ----------------------------------------------------- the cache and the step's buffers

class StaticDecoder:
    """Every tensor a decoding step reads or writes, allocated once at fixed shapes.

    The KV cache holds, per layer, keys and values of shape (B, kv_heads, W + T, head_dim):
    columns [0, W) the prompt, left-padded to width W, then one column per new token. A step
    reads the token drawn last, its RoPE position and cache column, the cache and the columns
    each row sees, and the noise q of its draw; it writes the next token and the rows that
    have ended. `graph`, when recorded, and `key`, what it was recorded for: `decoder_for`.
    """

    def __init__(self, model, batch, width, new_tokens, dtype, device):
        self.width, self.graph, self.key = width, None, None
        self.head_dim = model.model.layers[0].self_attn.head_dim
        shape = (batch, model.config.num_key_value_heads, width + new_tokens, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.model.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]          # (B, kv, W + T, d)
        self.visible = torch.zeros(shape[0], shape[2], dtype=torch.bool,
                                   device=device)       # (B, W + T) cache columns a row sees
        self.token = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) a_{t-1}
        self.position = torch.zeros_like(self.token)    # (B,) its RoPE position: real tokens
        self.column = torch.zeros(1, dtype=torch.long, device=device)     # (1,) W + t - 1
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)  # (B,) no EOS yet
        self.noise = torch.ones(batch, model.lm_head.weight.shape[0],
                                device=device)          # (B, V) fp32 q ~ Exp(1) of this draw


def heads(x, head_dim):
    """(B, n, heads * d) -> (B, heads, n, d)."""
    return x.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def rope(x, cos, sin):
    """Rotary position embedding, as Llama's: x cos + rotate_half(x) sin. x (B, h, n, d),
    cos and sin (B, n, d)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)       # (B, h, n, d)
    return x * cos[:, None] + rotated * sin[:, None]


def forward(model, decoder, ids, positions, columns, sees):
    """The Llama stack over n new tokens per row, against the cache.

    in:  ids and positions (B, n); columns (n,), the cache columns their keys and values go
         to; sees (B, 1, n, W + T) bool, the cache columns each new token attends to
    out: the final norm's hidden state (B, n, H)
    """
    body, (B, n), d = model.model, ids.shape, decoder.head_dim
    # grouped-query attention: the G query heads that share a key/value head (SmolLM2: 9
    # heads over 3) attend as one head of G n queries, with no copy of the cache
    G = model.config.num_attention_heads // model.config.num_key_value_heads
    sees = sees.repeat(1, 1, G, 1)                                  # (B, 1, G n, W + T)
    h = body.embed_tokens(ids)                                      # (B, n, H)
    cos, sin = body.rotary_emb(h, positions)                        # (B, n, d) each
    for layer, keys, values in zip(body.layers, decoder.keys, decoder.values):
        attention = layer.self_attn
        x = layer.input_layernorm(h)                                # (B, n, H)
        q = rope(heads(attention.q_proj(x), d), cos, sin)           # (B, heads, n, d) LoRA
        k = rope(heads(attention.k_proj(x), d), cos, sin)           # (B, kv_heads, n, d)
        v = heads(attention.v_proj(x), d)                           # (B, kv_heads, n, d) LoRA
        keys.index_copy_(2, columns, k.to(keys.dtype))              # cache[:, :, columns] = k
        values.index_copy_(2, columns, v.to(values.dtype))
        # softmax(q K^T / sqrt(d)) V over the cache columns each query sees
        a = F.scaled_dot_product_attention(q.reshape(B, -1, G * n, d), keys, values,
                                           attn_mask=sees, scale=attention.scaling)
        a = a.reshape(B, -1, n, d).transpose(1, 2).flatten(2)       # (B, n, heads * d)
        h = h + attention.o_proj(a)                                 # (B, n, H)
        h = h + layer.mlp(layer.post_attention_layernorm(h))        # (B, n, H)
    return body.norm(h)                                             # (B, n, H)


def prefill(model, decoder, prompt_ids, prompt_mask):
    """One pass over the prompts: the cache's prompt columns [0, W), and the first step's
    state. Returns the hidden state of s_0, the last prompt column, (B, H).

    The prompts (B, P) are left-padded further to the decoder's width W. Position ids count
    real tokens only (`loaders.positions`), and no token sees a padding column, so the
    padding is invisible; a padding token sees itself, so that no softmax is empty.
    """
    pad = decoder.width - prompt_ids.shape[1]
    ids = F.pad(prompt_ids, (pad, 0))                               # (B, W) padding: id 0
    mask = F.pad(prompt_mask, (pad, 0)).bool()                      # (B, W) real tokens
    decoder.visible.zero_()
    decoder.visible[:, :decoder.width] = mask                       # (B, W + T)
    query = torch.arange(decoder.width, device=ids.device)          # (W,) prompt columns
    key = torch.arange(decoder.visible.shape[1], device=ids.device)  # (W + T,) cache columns
    # a prompt token sees the real tokens at or before it, and itself
    sees = (decoder.visible[:, None] & (key <= query[:, None])) | (key == query[:, None])
    hidden = forward(model, decoder, ids, loaders.positions(mask), query,
                     sees[:, None])                                 # (B, W, H)
    decoder.position.copy_(mask.sum(1))             # a_0's position: the real prompt tokens
    decoder.column.fill_(decoder.width)             # a_0's cache column
    decoder.unfinished.fill_(True)
    return hidden[:, -1]                                            # (B, H) s_0


def choose(model, decoder, hidden, cfg, eos_id):
    """a_t ~ pi(. | s_t) for every row, into `decoder.token`; `decoder.noise` holds q.

    hidden (B, H), the last hidden state of s_t.
    """
    with loaders.heads_in_fp32(hidden):     # departure 1: fp32 logits, even under autocast
        logits = model.lm_head(hidden.float())                      # (B, V) fp32
    probs = filtered_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)        # (B, V)
    # a_t = argmax_i pi_i / q_i, q ~ Exp(1): torch.multinomial(pi, 1) as ATen draws it
    drawn = (probs / decoder.noise).argmax(-1)                      # (B,)
    # a row that has ended gets EOS (HF: next * unfinished + pad * (1 - unfinished))
    drawn = torch.where(decoder.unfinished, drawn, eos_id)          # (B,)
    decoder.unfinished &= drawn != eos_id
    decoder.token.copy_(drawn)


def step(model, decoder, cfg, eos_id):
    """One new token per row, at fixed shapes: a_{t-1} in at cache column W + t - 1, a_t
    drawn out. Reads and writes only `decoder`'s tensors, so CUDA can record it once."""
    decoder.visible.index_fill_(1, decoder.column, True)   # a_{t-1}'s column, seen from now
    hidden = forward(model, decoder, decoder.token[:, None], decoder.position[:, None],
                     decoder.column, decoder.visible[:, None, None])     # (B, 1, H)
    choose(model, decoder, hidden[:, -1], cfg, eos_id)
    decoder.position += 1
    decoder.column += 1


# ------------------------------------------------------------------ the CUDA graph

def record(model, decoder, cfg, eos_id):
    """`step` recorded once as a CUDA graph, after two warm-up steps on a side stream (as
    torch.cuda.graph's documentation asks). Under the caller's autocast, with its weight
    cache off (choice 2). The warm-up writes cache columns 0 and 1; `prefill` overwrites
    them and resets the step's state before any replay."""
    autocast = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"),
                              enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), autocast:
        for _ in range(2):
            step(model, decoder, cfg, eos_id)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), autocast:
        step(model, decoder, cfg, eos_id)
    return graph


GRAPHS = weakref.WeakKeyDictionary()    # model -> its StaticDecoder with a recorded graph


def decoder_for(model, prompt_ids, cfg, eos_id, graph):
    """A StaticDecoder for this call: a fresh one without the graph; with it, the model's
    recorded one while the shape, the sampler's settings and the weights' addresses hold
    (choice 3)."""
    device = prompt_ids.device
    dtype = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
             else model.lm_head.weight.dtype)           # the cache holds what attention reads
    width = max(prompt_ids.shape[1], cfg.prompt_tokens) if graph else prompt_ids.shape[1]
    shape = (len(prompt_ids), width, cfg.max_new_tokens, dtype)
    if not graph:
        return StaticDecoder(model, *shape, device)
    # What a recorded graph is bound to: its shapes, the sampler's constants, and the address
    # of every weight it reads (a module swapped, as by lora.merge_lora, records it again)
    key = (*shape, cfg.temperature, cfg.top_k, cfg.top_p, eos_id,
           tuple(p.data_ptr() for p in model.parameters()))
    decoder = GRAPHS.get(model)
    if decoder is None or decoder.key != key:
        GRAPHS.pop(model, None)                         # the old graph's memory first
        decoder = StaticDecoder(model, *shape, device)
        try:
            decoder.graph = record(model, decoder, cfg, eos_id)
        except RuntimeError as error:   # a driver or a torch that cannot record this step
            reason = " ".join(str(error).split())[:160]
            print(f"note: the decoding step could not be recorded as a CUDA graph ({reason}): "
                  "the same loop runs without it (--decoding static); --decoding hf is "
                  "Hugging Face's generate")
        decoder.key = key                               # tried once for these shapes
        GRAPHS[model] = decoder
    return decoder


# ------------------------------------------------------------------------- sampling

@torch.no_grad()
def sample(model, prompt_ids, prompt_mask, cfg, eos_id, graph=False):
    """Sample a summary per post, keeping the ids that were sampled: `ppo.generate`'s result.

    in:  prompt_ids and prompt_mask (B, P), left-padded; cfg's max_new_tokens, temperature,
         top_k, top_p (and prompt_tokens, the graph's width); graph: replay `step` as a CUDA
         graph (CUDA only)
    out: sequences (B, P+T) and actions (B, T). After a row's first EOS the row is EOS; T is
         the step at which every row has ended, or max_new_tokens.
    """
    decoder = decoder_for(model, prompt_ids, cfg, eos_id, graph)
    hidden = prefill(model, decoder, prompt_ids, prompt_mask)      # (B, H) s_0
    decoder.noise.exponential_(1)                   # q ~ Exp(1), as multinomial draws it
    choose(model, decoder, hidden, cfg, eos_id)     # a_0
    drawn = [decoder.token.clone()]
    while len(drawn) < cfg.max_new_tokens and decoder.unfinished.any():   # choice 4
        decoder.noise.exponential_(1)
        if decoder.graph:
            decoder.graph.replay()                  # `step`, as recorded
        else:
            step(model, decoder, cfg, eos_id)
        drawn.append(decoder.token.clone())         # a_t
    actions = torch.stack(drawn, 1)                                 # (B, T)
    return torch.cat([prompt_ids, actions], 1), actions             # (B, P+T), (B, T)
