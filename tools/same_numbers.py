"""Do two runs give the same numbers? A check that a change moved no behaviour.

    python -m tools.same_numbers BEFORE AFTER          (folders, or metrics.json/results.json)

BEFORE and AFTER are two folders of the same script, run with the same command on the
same machine: reward_model.py's (metrics.json) or ppo.py's (results.json). What is
compared, with `support.report.differences`, exactly unless --rel says otherwise:
    metrics.json   every number and text, the time taken aside
    results.json   the final held-out block (every number, sample and text) and every
                   iteration's row, times, memory, threads and commits aside
Keys that only AFTER has are additions, listed but not differences (a change may add a
measure without moving any). Exit status 0 when nothing differs, 1 otherwise.

On another CPU some figures drift by design (docs/reward_model.md, "Which figures repeat
where"); compare runs from one machine.
Test: pytest tests/test_ppo.py -k same_numbers
"""
import argparse
import json
import sys
from pathlib import Path

from support.report import differences

FILES = ("metrics.json", "results.json")
IGNORED = {"metrics.json": ("seconds", "sampling_seconds")}   # time taken, nothing else


def load(path):
    """{file name: its JSON} for a file, or for each of FILES in a folder."""
    path = Path(path)
    if path.is_file():
        return {path.name: json.loads(path.read_text())}
    found = {name: json.loads((path / name).read_text()) for name in FILES
             if (path / name).is_file()}
    if not found:
        sys.exit(f"same_numbers: error: {path} holds neither {' nor '.join(FILES)}")
    return found


def without(value, keys):
    """`value` with every dict key in `keys` removed, at any depth."""
    if isinstance(value, dict):
        return {k: without(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [without(v, keys) for v in value]
    return value


def added(before, after, where=""):
    """The keys AFTER has and BEFORE lacks, at any depth: ["where.key"]; and AFTER cut to
    BEFORE's keys, for the comparison."""
    if isinstance(before, dict) and isinstance(after, dict):
        new = [f"{where}.{k}" for k in after if k not in before]
        cut = {}
        for k in before:
            if k in after:
                more, cut[k] = added(before[k], after[k], f"{where}.{k}")
                new += more
        return new, cut
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        pairs = [added(b, a, f"{where}[{i}]") for i, (b, a) in enumerate(zip(before, after))]
        return [k for new, _ in pairs for k in new], [cut for _, cut in pairs]
    return [], after


def compare(before, after, rel=0.0):
    """(differences, additions) between two loaded runs ({file name: JSON})."""
    found, new = [], []
    for name in sorted(set(before) & set(after)):
        a, b = (without(x, IGNORED.get(name, ())) for x in (before[name], after[name]))
        if name == "results.json":          # the run's numbers, not its config or commits
            a, b = ({k: x.get(k) for k in ("iterations", "final")} for x in (a, b))
        more, b = added(a, b)
        new += [f"{name}{k}" for k in more]
        found += [f"{name}{d}" for d in differences(a, b, rel)]
    if not set(before) & set(after):
        found.append(f"nothing to compare: {sorted(before)} against {sorted(after)}")
    return found, new


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rel", type=float, default=0.0,
                        help="relative tolerance for floats (default 0: the same bits)")
    args = parser.parse_args(argv)
    found, new = compare(load(args.before), load(args.after), args.rel)
    for key in new:
        print(f"added: {key}")
    for line in found:
        print(f"DIFFERS: {line}")
    print(f"{len(found)} differences" + (f", {len(new)} keys added" if new else "")
          + f" ({args.before} -> {args.after})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
