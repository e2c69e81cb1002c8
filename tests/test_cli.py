"""Every bad input gets one clear line (cli.py), tested as a table of wrong invocations.

Each case runs a script's `main` through `cli.run_script`, as `python ppo.py ...` does, in
this process (no model loads for a bad flag, so the table takes seconds), and asserts:
    - a non-zero exit: 2 for a flag (argparse's own status), 1 for a file or a run;
    - a last line that names the offending flag or file;
    - no traceback;
    - nothing changed on disk: not --out, not the files the case reads.
Two cases run as real processes, to check what a user's terminal shows. Then the pieces:
the ranges, `new_folders`, --debug, the template's token count, the hub notice printed once.
"""

import dataclasses
import json
import shutil
import subprocess
import time
import sys
from pathlib import Path

import pytest

from support import cli
import loaders
import ppo
import reward_model as rm
import sft
from test_reward_model import tiny_settings

ROOT = Path(__file__).resolve().parent.parent
PPO = "ppo --preset tiny --reward-model {w}/rm --out {w}/out"
RM = "rm --preset tiny --out {w}/out"
SFT = "sft --preset tiny --out {w}/out"

# (invocation, what the last line must name). {w} is the `world` folder below.
CASES = [
    # ppo.py: counts >= 1
    (f"{PPO} --batch 0", "--batch"),
    (f"{PPO} --iterations -1", "--iterations"),
    (f"{PPO} --micro-batch 0", "--micro-batch"),
    (f"{PPO} --inner-steps 0", "--inner-steps"),
    (f"{PPO} --max-new-tokens 0", "--max-new-tokens"),
    (f"{PPO} --eval-prompts 0", "--eval-prompts"),
    (f"{PPO} --checkpoint-every 0", "--checkpoint-every"),
    # ppo.py: ranges
    (f"{PPO} --clip 0", "--clip"),                    # no update at all: refused
    (f"{PPO} --clip 1.5", "--clip"),
    (f"{PPO} --beta -0.1", "--beta"),
    (f"{PPO} --beta 0 0.1 0", "--beta"),              # a repeated run
    (f"{PPO} --gamma 1.1", "--gamma"),
    (f"{PPO} --lam -0.5", "--lam"),
    (f"{PPO} --lr 0", "--lr"),
    (f"{PPO} --value-lr nan", "--value-lr"),
    (f"{PPO} --temperature 0", "--temperature"),
    (f"{PPO} --top-p 0", "--top-p"),
    (f"{PPO} --top-k -1", "--top-k"),
    (f"{PPO} --target-kl 0", "--target-kl"),
    (f"{PPO} --prompt-tokens 10", "--prompt-tokens"),  # less than the template itself
    (f"{PPO} --preset huge", "--preset"),
    (f"{PPO} --reward length", "--reward"),
    (f"{PPO} --decoding graph", "--decoding"),
    # ppo.py: folders and files
    (f"{PPO} --out {{w}}/a_file", "a_file"),
    (f"{PPO} --data-dir {{w}}/missing", "--data-dir"),
    (f"{PPO} --model ./no_such_model", "--model"),
    (f"{PPO} --model {{w}}/empty", "empty"),                      # a folder with no model
    (f"{PPO} --model {{w}}/half_sft", "half_sft"),                # config.json, no weights
    (f"{PPO} --data-dir {{w}}/empty", "empty"),
    (f"{PPO} --data-dir {{w}}/bad_csv", "posts.csv"),
    (f"{PPO} --reward-model {{w}}/missing_rm", "missing_rm"),
    (f"{PPO} --reward-model {{w}}/rm_bad_head", "head.safetensors"),
    (f"{PPO} --reward-model {{w}}/rm_bad_config", "config.json"),
    (f"{PPO} --data-dir {{w}}/small --eval-prompts 40", "--eval-prompts"),
    (f"{PPO} --data-dir {{w}}/small --prompt-tokens 24", "--prompt-tokens"),  # titles too long
    # ppo.py: --resume and the folder of an earlier run
    (f"{PPO} --resume --out {{w}}/empty", "checkpoint"),
    (f"{PPO} --resume --out {{w}}/run --beta 0.5", "beta 0.1 there, 0.5 now"),
    (f"{PPO} --resume --out {{w}}/run --seeds 3 --preset tiny", "seed 0 there, 3 now"),
    (f"{PPO} --out {{w}}/run", "--resume continues it"),      # would write over a run
    (f"{PPO} --resume --out {{w}}/run_bad_checkpoint --data-dir {{w}}/small",
     "adapter.safetensors"),
    # reward_model.py
    (f"{RM} --epochs 0", "--epochs"),
    (f"{RM} --batch-pairs 0", "--batch-pairs"),
    (f"{RM} --lr -1", "--lr"),
    (f"{RM} --head-lr 0", "--head-lr"),
    (f"{RM} --heldout-fraction 1", "--heldout-fraction"),
    (f"{RM} --max-prompt-tokens 3", "--max-prompt-tokens"),
    (f"{RM} --max-summary-tokens 0", "--max-summary-tokens"),
    (f"{RM} --seed -1", "--seed"),
    (f"{RM} --reference-pairs -4", "--reference-pairs"),
    (f"{RM} --eval-batch 0", "--eval-batch"),
    (f"{RM} --preset bogus", "--preset"),
    (f"{RM} --out {{w}}/a_file", "a_file"),
    (f"{RM} --out {{w}}/a_file/rm", "a_file"),
    (f"{RM} --data-dir {{w}}/empty", "--data-dir"),
    (f"{RM} --model {{w}}/half_sft", "half_sft"),
    (f"{RM} --data-dir {{w}}/bad_batch", "batch1.json"),
    (f"{RM} --lora-layers 99", "--lora-layers"),
    (f"{RM} --max-prompt-tokens 24", "--max-prompt-tokens"),       # every title too long
    (f"{RM} --min-heldout-pairs 100000", "--min-heldout-pairs"),
    # sft.py
    (f"{SFT} --steps 0", "--steps"),
    (f"{SFT} --batch 0", "--batch"),
    (f"{SFT} --micro-batch 0", "--micro-batch"),
    (f"{SFT} --lr 0", "--lr"),
    (f"{SFT} --schedule cosine", "--schedule"),
    (f"{SFT} --prompt-tokens 10", "--prompt-tokens"),
    (f"{SFT} --eval-prompts 300", "--eval-prompts"),
    (f"{SFT} --eval-every 0", "--eval-every"),
    (f"{SFT} --max-new-tokens 0", "--max-new-tokens"),
    (f"{SFT} --lora-layers -1", "--lora-layers"),
    (f"{SFT} --lora-layers 99", "--lora-layers"),                  # more than the model has
    (f"{SFT} --out {{w}}/a_file", "a_file"),
    (f"{SFT} --data-dir {{w}}/missing", "--data-dir"),
    (f"{SFT} --model ./no_such_model", "--model"),
    (f"{SFT} --model {{w}}/empty", "empty"),
    (f"{SFT} --data-dir {{w}}/empty", "empty"),
    (f"{SFT} --data-dir {{w}}/small --eval-prompts 40", "--eval-prompts"),
    (f"{SFT} --reward-model {{w}}/rm_bad_head --data-dir {{w}}/sft_data", "head.safetensors"),
]
MAINS = {"ppo": ppo.main, "rm": rm.main, "sft": sft.main}


@pytest.fixture(scope="module")
def world(tmp_path_factory, small_data, sft_data):
    """Files for the cases to trip on: a file where a folder belongs, an empty folder, bad
    data, a tiny reward model (good, and two broken copies), an earlier run folder, and one
    whose checkpoint is corrupt."""
    w = tmp_path_factory.mktemp("world")
    (w / "a_file").write_text("not a folder")
    (w / "empty").mkdir()
    (w / "half_sft").mkdir()                            # sft.py's output, stopped half-way
    (w / "half_sft" / "config.json").write_text('{"model_type": "llama"}')
    (w / "bad_csv" / "tldr_validation_samples").mkdir(parents=True)
    (w / "bad_csv" / "tldr_validation_samples" / "posts.csv").write_text("title,body\na,b\n")
    (w / "bad_batch" / "summarize_from_feedback_comparisons").mkdir(parents=True)
    (w / "bad_batch" / "summarize_from_feedback_comparisons" / "batch1.json").write_bytes(
        b"\xff\xfe not json")
    shutil.copytree(small_data, w / "small")            # 40 real posts
    shutil.copytree(sft_data, w / "sft_data")           # 320: sft.py's tiny preset trains
    # a tiny reward model, untrained (loading is what is tested), and two broken copies
    model, _ = rm.build_reward_model(tiny_settings())
    (w / "rm").mkdir()
    rm.save_reward_model(model, w / "rm")
    for name, broken in (("rm_bad_head", "head.safetensors"), ("rm_bad_config", "config.json")):
        shutil.copytree(w / "rm", w / name)
        (w / name / broken).write_bytes(b"\x00" * 5 + b"truncated")
    # an earlier run (beta 0.1, seed 0), and one whose adapter checkpoint is corrupt
    for name, extra in (("run", []), ("run_bad_checkpoint", ["--data-dir", f"{w}/small"])):
        cfg = ppo.parse_args(["--preset", "tiny", "--reward-model", f"{w}/rm",
                              "--out", f"{w}/{name}", *extra])
        (w / name / "checkpoint").mkdir(parents=True)
        (w / name / "results.json").write_text(json.dumps(
            {"config": {**dataclasses.asdict(cfg), "beta": 0.1, "seed": 0}, "iterations": []}))
        (w / name / "checkpoint" / "state.json").write_text(json.dumps(
            {"iteration": 1, "beta": 0.1, "optimizer_scalars": {}}))
        (w / name / "checkpoint" / "adapter.safetensors").write_bytes(b"\x00" * 16)
    return w


def snapshot(folder):
    """Every path under `folder` with its bytes (None for a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
            for p in sorted(folder.rglob("*"))}


def invoke(main, argv, capsys):
    """(exit status, everything printed, the last line) of `python script.py argv`."""
    with pytest.raises(SystemExit) as stop:
        cli.run_script(main, argv)
    out, err = capsys.readouterr()
    code = stop.value.code
    if isinstance(code, str):                   # sys.exit(message): Python prints it, status 1
        err, code = err + code + "\n", 1
    lines = [line for line in (out + err).splitlines() if line.strip()]
    return code, out + err, lines[-1] if lines else ""


def test_the_table_covers_both_scripts_and_enough_cases():
    scripts = [case.split()[0] for case, _ in CASES]
    assert len(CASES) >= 25 and scripts.count("ppo") >= 10 and scripts.count("rm") >= 10
    assert scripts.count("sft") >= 10


@pytest.mark.parametrize("case, names", CASES, ids=[c for c, _ in CASES])
def test_a_bad_invocation_ends_with_one_line_that_names_it(case, names, world, capsys):
    script, *argv = case.format(w=world).split()
    before = snapshot(world)
    code, printed, last = invoke(MAINS[script], argv, capsys)
    assert code in (1, 2)
    assert names in last and "error: " in last, last
    assert "Traceback" not in printed
    assert snapshot(world) == before            # no --out made, nothing read was changed
    assert not (world / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("argv, status, names", [
    (["ppo.py", "--preset", "tiny", "--clip", "0"], 2, "--clip"),
    (["reward_model.py", "--preset", "tiny", "--data-dir", "{w}/empty"], 1, "--data-dir"),
])
def test_what_a_terminal_shows(argv, status, names, world):
    argv = [a.format(w=world) for a in argv] + ["--out", str(world / "out")]
    result = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == status
    last = result.stderr.strip().splitlines()[-1]
    assert names in last and last.startswith(f"{argv[0]}: error: ")
    assert "Traceback" not in result.stdout + result.stderr
    assert not (world / "out").exists()


def test_debug_shows_the_traceback(world):
    with pytest.raises(loaders.DataError):
        cli.run_script(rm.main, ["--preset", "tiny", "--data-dir", str(world / "empty"),
                                 "--out", str(world / "out"), "--debug"])


def test_a_bug_is_not_dressed_up_as_a_user_error():
    def main(argv):
        return {}["missing"]
    with pytest.raises(KeyError):
        cli.run_script(main, [])


def test_ranges_describe_themselves_and_refuse_nan():
    assert cli.Range(0, 1, low_open=True, high_open=True).describe("clip") == "0 < clip < 1"
    assert cli.COUNT.describe("batch") == "batch >= 1"
    assert cli.POSITIVE.describe("lr") == "lr > 0"
    assert cli.Range(0, 1, low_open=True).describe("top-p") == "0 < top-p <= 1"
    assert 1 in cli.COUNT and 0 not in cli.COUNT
    assert 0 not in cli.POSITIVE and 1e-9 in cli.POSITIVE
    for bad in (float("nan"), float("inf")):
        assert bad not in cli.POSITIVE and bad not in cli.FINITE


def test_every_default_and_preset_passes_its_own_checks():
    for preset in ("blog", "cpu", "tiny"):
        ppo.parse_args(["--preset", preset])
        rm.parse_config(["--preset", preset])
        sft.parse_args(["--preset", preset])


def test_new_folders_removes_only_what_a_failed_run_made(tmp_path):
    target = tmp_path / "a" / "b"
    with pytest.raises(ZeroDivisionError):
        with cli.new_folders(target):
            (target / "results.json").write_text("{}")
            1 / 0
    assert list(tmp_path.iterdir()) == []       # neither a/b nor a
    with pytest.raises(ZeroDivisionError):      # a run that left a checkpoint keeps it
        with cli.new_folders(target, keep=lambda path: (path / "checkpoint").exists()):
            (target / "checkpoint").mkdir()
            1 / 0
    assert (target / "checkpoint").is_dir()
    with pytest.raises(ZeroDivisionError):      # a folder that was there before stays
        with cli.new_folders(target):
            1 / 0
    assert (target / "checkpoint").is_dir()


# A script stopped by `kill` while it fills a new run folder (new_folders, as ppo.py) and a
# staging folder beside another output (write_aside, as reward_model.py).
STOPPED_SCRIPT = """
import sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from support import cli
from support.report import write_aside

def main(argv):
    out = Path(argv[0])
    with cli.new_folders(out / "sweep" / "beta0_seed0"):
        def make(staging):
            (staging / "adapter.safetensors").write_text("half")
            print("ready", flush=True)
            time.sleep(60)
        write_aside(out / "reward_model", make)

cli.run_script(main)
"""


@pytest.mark.slow
def test_sigterm_leaves_no_half_made_folder(tmp_path):
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED_SCRIPT.format(root=str(ROOT)))
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, str(script), str(out)], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.readline().strip() == "ready"
    assert (out / "sweep" / "beta0_seed0").is_dir() and len(list(out.iterdir())) == 2
    process.terminate()                                     # SIGTERM, as `kill` sends
    _, err = process.communicate(timeout=30)
    assert process.returncode == 143, err
    assert not out.exists()                     # the run folder, the staging folder, out
    assert err.strip().splitlines() == ["stopped.py: stopped by SIGTERM"]


def test_the_template_token_count_is_the_tokenizers(tokenizer):
    empty = loaders.format_prompt("", "", "")
    assert len(tokenizer(empty).input_ids) == loaders.PROMPT_TEMPLATE_TOKENS


def test_hub_unreachable_is_said_once(monkeypatch, capsys):
    import huggingface_hub
    monkeypatch.setattr(loaders, "hub_reachable", lambda timeout=None: False)
    monkeypatch.setattr(loaders, "embedded_model_dir", lambda: Path("/embedded"))
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    loaders._resolve_model.cache_clear()
    try:
        assert loaders.resolve_model() == loaders.resolve_model(loaders.POLICY_NAME)
        assert capsys.readouterr().out.count("hub unreachable") == 1
    finally:
        loaders._resolve_model.cache_clear()    # later tests resolve for real


def test_no_data_anywhere_is_one_line_within_seconds(monkeypatch, capsys, tmp_path):
    """Issue 23: a clone with no ../shared/data, no --data-dir and no hub. The data must fail
    as the model does: one line that says where data is looked for, without the datasets
    library's ~25 s of retries (here load_dataset is not even called), and nothing written."""
    import datasets
    nowhere = tmp_path / "no_shared_data"
    monkeypatch.delenv(loaders.DATA_ENV, raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(loaders, "SHARED_DATA", nowhere)
    monkeypatch.setattr(loaders, "hub_reachable", lambda timeout=None: False)

    def no_hub(*args, **kwargs):
        raise AssertionError("load_dataset called although the hub did not answer")
    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    for load in (loaders.load_tldr, loaders.load_comparisons):
        start = time.perf_counter()
        with pytest.raises(loaders.DataError) as error:
            load()
        assert time.perf_counter() - start < 1
        for where in ("--data-dir", loaders.DATA_ENV, str(nowhere), "huggingface.co"):
            assert where in str(error.value)
    model, _ = rm.build_reward_model(tiny_settings())    # untrained: ppo.py needs a folder
    (tmp_path / "rm").mkdir()
    rm.save_reward_model(model, tmp_path / "rm")
    for main, argv in ((rm.main, ["--preset", "tiny"]),
                       (ppo.main, ["--preset", "tiny", "--reward-model", str(tmp_path / "rm")])):
        code, _, last = invoke(main, [*argv, "--out", str(tmp_path / "out")], capsys)
        assert code == 1 and "--data-dir" in last and str(nowhere) in last
        assert not (tmp_path / "out").exists()
    # HF_HUB_OFFLINE=1 tries the Hugging Face cache; a miss there is the same one line
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def not_cached(*args, **kwargs):
        raise ConnectionError("Couldn't reach the hub: offline mode is enabled")
    monkeypatch.setattr(datasets, "load_dataset", not_cached)
    with pytest.raises(loaders.DataError, match="--data-dir"):
        loaders.load_tldr()


@pytest.mark.parametrize("module, config, exempt", [
    (ppo, ppo.Config, set(ppo.CHOICES)),
    (rm, rm.Config, set(rm.CHOICES)),
    (sft, sft.Config, set(sft.CHOICES)),
])
def test_every_numeric_flag_has_a_range_and_every_text_flag_its_choices(module, config,
                                                                         exempt):
    """A flag added later without a range would let its bad values through: caught here."""
    for field in dataclasses.fields(config):
        default = field.default
        if field.name in ("model", "data_dir", "out", "reward_model") or field.type is bool:
            continue
        numeric = field.type in (int, float, list) or isinstance(default, (int, float))
        assert (field.name in module.RANGES) if numeric else (field.name in exempt), field.name
