"""The house's layers, read from the import statements (no module is imported here).

    stage scripts   sft.py, reward_model.py, ppo.py (dpo.py where it exists): nothing
                    imports them but tools/ and tests/
    support/        the plumbing: imports loaders, gae, lora, ppo_kernels and other support
                    modules, never a stage script
    support/cli.py  the one-line errors: imports no module of this project, so loaders.py
                    (a piece of the stage scripts, below support/) can raise its UserError
                    without a cycle; support/devices.py (the device, read through loaders.py)
                    imports none but cli, for the same reason
And no module imports one of ours inside a function (the way a cycle is hidden).
Test: pytest tests/test_layout.py
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = {"sft", "reward_model", "ppo", "dpo"}
OURS = {p.stem for p in ROOT.glob("*.py")} | {"support", "ppo_kernels", "tools"}


def imports(path):
    """(top-level module name, inside a function?) of every import statement in `path`."""
    tree, found = ast.parse(path.read_text()), []

    def visit(node, inside):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((a.name.split(".")[0], inside) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                found.append((child.module.split(".")[0], inside))
            visit(child, inside or isinstance(child, (ast.FunctionDef,
                                                        ast.AsyncFunctionDef)))
    visit(tree, False)
    return found


def test_the_reader_finds_imports_at_the_top_and_inside_functions(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom support import cli\n\ndef f():\n    import ppo\n")
    assert imports(probe) == [("os", False), ("support", False), ("ppo", True)]


def test_no_support_module_imports_a_stage_script():
    climbing = {f"{p.name}: {name}" for p in (ROOT / "support").glob("*.py")
                for name, _ in imports(p) if name in STAGES}
    assert not climbing


def test_cli_imports_no_module_of_this_project():
    assert not {name for name, _ in imports(ROOT / "support" / "cli.py") if name in OURS}


def test_devices_imports_no_module_of_this_project_but_cli():
    found = [(node.module, [a.name for a in node.names])
             for node in ast.walk(ast.parse((ROOT / "support" / "devices.py").read_text()))
             if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] in OURS]
    assert found == [("support", ["cli"])]
    assert not {name for name, _ in imports(ROOT / "support" / "devices.py")
                if name in OURS - {"support"}}


def test_no_module_imports_one_of_ours_inside_a_function():
    files = [*ROOT.glob("*.py"), *(ROOT / "support").glob("*.py"),
             *(ROOT / "ppo_kernels").glob("*.py")]
    hidden = {f"{p.name}: {name}" for p in files for name, inside in imports(p)
              if inside and name in OURS}
    assert not hidden
