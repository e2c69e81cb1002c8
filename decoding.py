"""Sampling the summaries over a static KV cache: the post's `generate`, at fixed shapes.

The post's `generate` (section "Generating and scoring") calls Hugging Face's
`model.generate(do_sample=True, top_k=TOP_K, top_p=TOP_P, temperature=TEMPERATURE)`, which
spends each new token in Python: a growing cache, masks rebuilt, about 1,400 kernels launched
one by one (30-40 ms a token on an H200). `sample` draws the same tokens from the same
distribution with every tensor at a fixed shape, so that on CUDA one step is recorded once as
a CUDA graph and replayed for each new token (`way`: --decoding auto on CUDA).

    prefill   one pass over the prompts, left-padded to width W: their keys and values cached
    step      a_{t-1} in at cache column W + t - 1, a_t out, t = 1 .. T-1; a row that drew
              EOS gets EOS after it, and the loop stops once every row has one, as `generate`
    sampler   z = logits(s_t) / tau;  top-k, then top-p, as TopK- and TopPLogitsWarper;
              pi = softmax(z);  a_t = argmax_i pi_i / q_i,  q_i ~ Exp(1)

The last line is `torch.multinomial(pi, 1)` as ATen computes it (the Gumbel-max trick). q is
drawn into a buffer before each step, outside the graph, so the random stream is the one
`generate` draws: on the CPU `sample` gives Hugging Face's ids for a seed (tested). The Llama
layers run here (`forward`: norm, q/k/v through the LoRA modules, RoPE, grouped-query
attention over the cache, MLP), not through transformers' StaticCache, whose forward rebuilds
its masks in Python and whose arguments moved between versions. A recorded graph reads the
live weights, so the adapter the optimizer updates in place is the one each replay uses; a
`GraphCache` keeps one per model and records again when a shape, a sampler setting or a
weight's address changes.

Departure from Hugging Face's `generate`, ppo.py's departure 7 (speed, same algorithm), said
again at its line: the logits come from the LM head in fp32 even under bf16 autocast, and
attention runs masked over the whole cache through torch's kernel, its sums in another order
(logits within 2e-6 of their range of Hugging Face's: no draw differed in 2,304 of SmolLM2's).

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
        # softmax(q K^T / sqrt(d)) V over the cache columns each query sees (ppo.py's
        # departure 7: masked over the whole cache, torch's kernel, its sums in another order)
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
    with loaders.heads_in_fp32(hidden):     # ppo.py's departure 7: fp32 logits under autocast
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
    torch.cuda.graph's documentation asks). Under the caller's autocast, with its cache of
    bf16 weight copies off: a copy cast before the recording would be read ever after. The
    warm-up writes cache columns 0 and 1; `prefill` overwrites them and resets the step's
    state before any replay."""
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


def way(decoding, device):
    """How `ppo.generate` samples, from --decoding and the device: "hf" (Hugging Face's
    `generate`, the post's call), "static" (`sample` without a graph) or "graph" (`sample`
    with its step replayed as a CUDA graph). auto: the graph on CUDA, `generate` elsewhere,
    so that the CPU's numbers are Hugging Face's."""
    if decoding == "auto":
        return "graph" if torch.device(device).type == "cuda" else "hf"
    return decoding


class GraphCache:
    """The recorded decoding step of each model, kept while the model lives.

    Maps a model (weakly: freed with the policy) to its StaticDecoder with a recorded graph.
    The graph's prompt columns are padded on the left up to --prompt-tokens, so one graph
    serves every iteration; it is recorded again when the batch, the sampler's settings or a
    weight's address change (a module swapped, as by lora.merge_lora, would be read no more).
    Where the step cannot be recorded (a driver or a torch that refuses it), one line says
    so, the same loop runs without the graph, and recording is not retried for that shape.
    """

    def __init__(self):
        self.decoders = weakref.WeakKeyDictionary()     # model -> StaticDecoder

    def decoder(self, model, shape, device, cfg, eos_id):
        """The model's recorded StaticDecoder for `shape` (B, W, T, dtype), recorded now if
        the one kept was recorded for another shape, other settings or other weights."""
        key = (*shape, cfg.temperature, cfg.top_k, cfg.top_p, eos_id,
               tuple(p.data_ptr() for p in model.parameters()))
        decoder = self.decoders.get(model)
        if decoder is not None and decoder.key == key:
            return decoder
        self.decoders.pop(model, None)                  # the old graph's memory first
        decoder = StaticDecoder(model, *shape, device)
        try:
            decoder.graph = record(model, decoder, cfg, eos_id)
        except RuntimeError as error:   # a driver or a torch that cannot record this step
            reason = " ".join(str(error).split())[:160]
            print(f"note: the decoding step could not be recorded as a CUDA graph ({reason}): "
                  "the same loop runs without it (--decoding static); --decoding hf is "
                  "Hugging Face's generate")
        decoder.key = key                               # tried once for these shapes
        self.decoders[model] = decoder
        return decoder


# The recorded steps of this process's policies: what ppo.generate replays with --decoding
# auto on CUDA. Tests pass their own GraphCache.
CUDA_GRAPHS = GraphCache()


def decoder_for(model, prompt_ids, cfg, eos_id, graphs=None):
    """A StaticDecoder for this call: a fresh one at the prompts' width without `graphs`;
    with a GraphCache, the model's recorded one, at width --prompt-tokens."""
    device = prompt_ids.device
    dtype = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
             else model.lm_head.weight.dtype)           # the cache holds what attention reads
    if graphs is None:
        return StaticDecoder(model, len(prompt_ids), prompt_ids.shape[1], cfg.max_new_tokens,
                             dtype, device)
    width = max(prompt_ids.shape[1], cfg.prompt_tokens)
    return graphs.decoder(model, (len(prompt_ids), width, cfg.max_new_tokens, dtype), device,
                          cfg, eos_id)


# ------------------------------------------------------------------------- sampling

@torch.no_grad()
def sample(model, prompt_ids, prompt_mask, cfg, eos_id, graphs=None):
    """Sample a summary per post, keeping the ids that were sampled: `ppo.generate`'s result.

    in:  prompt_ids and prompt_mask (B, P), left-padded; cfg's max_new_tokens, temperature,
         top_k, top_p (and prompt_tokens, the graph's width); graphs: a GraphCache to record
         `step` in and replay it from as a CUDA graph (CUDA only), or None: the eager loop
    out: sequences (B, P+T) and actions (B, T). After a row's first EOS the row is EOS; T is
         the step at which every row has ended, or max_new_tokens.
    """
    decoder = decoder_for(model, prompt_ids, cfg, eos_id, graphs)
    hidden = prefill(model, decoder, prompt_ids, prompt_mask)      # (B, H) s_0
    decoder.noise.exponential_(1)                   # q ~ Exp(1), as multinomial draws it
    choose(model, decoder, hidden, cfg, eos_id)     # a_0
    drawn = [decoder.token.clone()]
    # one host sync a step, to stop where `generate` stops (same T, the same draws)
    while len(drawn) < cfg.max_new_tokens and decoder.unfinished.any():
        decoder.noise.exponential_(1)
        if decoder.graph:
            decoder.graph.replay()                  # `step`, as recorded
        else:
            step(model, decoder, cfg, eos_id)
        drawn.append(decoder.token.clone())         # a_t
    actions = torch.stack(drawn, 1)                                 # (B, T)
    return torch.cat([prompt_ids, actions], 1), actions             # (B, P+T), (B, T)
