"""The package's layering (docs/architecture.md): brrr's modules import one another in one
direction, without cycles and without another module's private names, and `import brrr` loads
only what a call needs. Read from the source, every import counted, at any depth of a module."""

import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PACKAGE = os.path.join(REPO, "brrr")

# Lowest first: a module imports modules of its own layer or of lower ones (brrr._C: the extension).
LAYERS = [
    {"_C", "_args", "_integration", "diagnose.common"},
    {"_op", "_registry"},  # the PyTorch factory and the registry's machinery
    {"_frameworks"},  # which framework a tensor belongs to; the first torch tensor loads _op
    {"chain", "glu", "dropout", "norm", "rotary", "softmax", "xent"},  # the families
    {"remat", "graphs", "diagnose.step"},
    {"nn", "diagnose"},
    {"_patch"},
    {"__init__", "__main__"},
]


def modules():
    """{name: path}: brrr/x.py as x, brrr/diagnose/y.py as diagnose.y, a package's __init__ by its name."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        prefix = os.path.relpath(folder, PACKAGE).replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                name = f[:-3] if prefix == "." else f"{prefix}.{f[:-3]}"
                found[name.removesuffix(".__init__") if name != "__init__" else name] = os.path.join(folder, f)
    return found


def resolve(importer, level, module):
    """The brrr module a relative import names (None outside brrr)."""
    parts = importer.split(".")
    package = parts[:-1] if not os.path.basename(modules()[importer]) == "__init__.py" else parts
    if importer == "__init__":
        package = []
    base = package[:len(package) - (level - 1)] if level > 1 else package
    return ".".join(base + ([module] if module else [])) or "__init__"


def imports(name, path):
    """[(module imported, names taken from it)], and the private attributes read off imported modules."""
    tree = ast.parse(open(path).read())
    found, aliases, private = [], {}, []
    known = modules()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            target = resolve(name, node.level, node.module)
            for alias in node.names:
                submodule = f"{target}.{alias.name}" if target != "__init__" else alias.name
                if submodule in known or submodule == "_C":
                    found.append((submodule, []))
                    aliases[alias.asname or alias.name] = submodule
                else:
                    found.append((target, [alias.name]))
        elif isinstance(node, ast.Import):
            found += [(a.name.removeprefix("brrr."), []) for a in node.names if a.name.startswith("brrr.")]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if aliases[node.value.id] != "_C" and node.attr.startswith("_") and not node.attr.startswith("__"):
                private.append(f"{aliases[node.value.id]}.{node.attr}")
    return found, private


def graph():
    return {name: imports(name, path) for name, path in modules().items()}


def layer_of(name):
    return next(i for i, layer in enumerate(LAYERS) if name in layer)


def test_every_module_has_a_layer():
    assert set(modules()) | {"_C"} == set().union(*LAYERS)


def test_imports_go_down_the_layers():
    upward = [(name, target) for name, (found, _) in graph().items() for target, _ in found
              if target != name and layer_of(target) > layer_of(name)]
    assert not upward


def test_no_import_cycles():
    edges = {name: {target for target, _ in found if target != name} for name, (found, _) in graph().items()}

    def reaches(start, goal, seen):
        for n in edges.get(start, ()):
            if n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen)):
                return True
        return False

    assert not [name for name in edges if reaches(name, name, set())]


def test_no_private_names_across_modules():
    crossing = [(name, f"{target}.{n}") for name, (found, _) in graph().items() for target, names in found
                for n in names if n.startswith("_") and not n.startswith("__") and target != name]
    crossing += [(name, attribute) for name, (_, private) in graph().items() for attribute in private]
    assert not crossing


def loaded_after(code):
    result = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(sorted(m for m in sys.modules "
                             "if m == 'brrr' or m.startswith('brrr.')))"],
                            env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return set(eval(result.stdout.splitlines()[-1]))


FAMILIES = {"brrr.chain", "brrr.glu", "brrr.dropout", "brrr.norm", "brrr.rotary", "brrr.softmax", "brrr.xent"}
CORE = {"brrr", "brrr._C", "brrr._args", "brrr._frameworks", "brrr._integration"} | FAMILIES


@pytest.mark.parametrize("code, extra", [
    ("import brrr", set()),  # no torch: no PyTorch layer
    ("import torch, brrr", {"brrr._op", "brrr._registry"}),
    ("import brrr, torch; brrr.gelu(torch.ones(3))", {"brrr._op", "brrr._registry"}),
    ("import brrr, numpy; brrr.gelu(numpy.ones(3, numpy.float32))", set()),
    ("import torch, brrr; brrr.registry", {"brrr._op", "brrr._registry"}),
    ("import torch, brrr; brrr.nn", {"brrr._op", "brrr._registry", "brrr.nn", "brrr.remat"}),
    ("import brrr; brrr.diagnose", {"brrr.diagnose", "brrr.diagnose.common"}),
])
def test_import_loads_only_what_the_call_needs(code, extra):
    assert loaded_after(code) == CORE | extra
