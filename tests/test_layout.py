"""The package's layout: its layers import downward only, across layers through the
layer's package, and no unit grows past the size a reader takes in at once.

Read from the source files the tests run against (the installed package, or the tree),
so the check holds for what ships.
"""
import ast
import os

import onnx_offload

PACKAGE = os.path.dirname(os.path.abspath(onnx_offload.__file__))
ROOT = os.path.dirname(PACKAGE)

# Bottom up. A module may import from its own rank or below.
RANKS = {
    "base": 0,  # errors, config, interrupts, progress, install, the compiled core
    "loading": 1,
    "memory": 2,
    "engines": 3,
    "generation": 4,
    "front": 5,  # the session, its members, the package's own __init__
    "devices": 5,  # a model split across devices, each stage a session
    "tools": 6,
    "models": 6,  # the model generators the tools and the tests use
    "entry": 7,  # python -m onnx_offload
}
BASE = {"errors", "config", "interrupts", "progress", "install", "_core"}
LAYERS = {"loading", "memory", "engines", "generation", "devices", "tools", "models"}


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def layer(module: str) -> str:
    """The layer of a module named relative to the package ('memory.device', 'session')."""
    head = module.split(".")[0]
    if head in LAYERS:
        return head
    if head in BASE:
        return "base"
    if head == "__main__":
        return "entry"
    return "front"


def modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, ".")
                yield path, rel


def imports(path: str, rel: str, modules_named: bool = False):
    """(line, the module imported relative to the package) for each import of the
    package's own modules, function-level imports included. `modules_named`: also
    whether the import names the module itself (`from ..memory import host_store`)
    rather than names from it."""
    package = rel.split(".")[:-1]  # a package's __init__ imports relative to the package itself
    for node in ast.walk(ast.parse(read(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                target = base + (node.module.split(".") if node.module else [])
                if not node.module:  # from . import a, b: modules or names of the package
                    for alias in node.names:
                        found = (node.lineno, ".".join(target + [alias.name]))
                        yield found + ((True,) if modules_named else ())
                    continue
                yield (node.lineno, ".".join(target)) + ((False,) if modules_named else ())
            elif node.module and node.module.split(".")[0] == "onnx_offload":
                yield (node.lineno, ".".join(node.module.split(".")[1:])) + ((False,) if modules_named else ())
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "onnx_offload":
                    yield (node.lineno, ".".join(alias.name.split(".")[1:])) + ((True,) if modules_named else ())


def test_layers_import_downward_only():
    upward = []
    for path, rel in modules():
        for line, target in imports(path, rel):
            if target and RANKS[layer(target)] > RANKS[layer(rel)]:
                upward.append(f"{rel}:{line} imports {target} ({layer(rel)} -> {layer(target)})")
    assert not upward, "\n".join(upward)


def test_imports_across_layers_go_through_the_layer_s_package():
    """`from ..memory import Device`, not `from ..memory.device import Device`: a layer may
    rearrange its modules without its importers changing. The tools, which reach into
    the layers to test them, are exempt."""
    reaching = []
    for path, rel in modules():
        if layer(rel) in ("tools", "entry"):
            continue
        for line, target, module_named in imports(path, rel, modules_named=True):
            parts = target.split(".")
            if parts[0] in LAYERS and parts[0] != rel.split(".")[0] and len(parts) > 1 and not module_named:
                reaching.append(f"{rel}:{line} imports {target}")
    assert not reaching, "\n".join(reaching)


def test_no_lower_layer_imports_the_session():
    for path, rel in modules():
        if RANKS[layer(rel)] < RANKS["front"]:
            assert not [t for _, t in imports(path, rel) if t.split(".")[0] == "session"], rel


def test_no_module_over_400_lines_and_no_class_over_300():
    big = []
    for path, rel in modules():
        source = read(path)
        if source.count("\n") > 400:
            big.append(f"{rel}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                big.append(f"{rel}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big, "\n".join(big)


def test_no_cpp_source_over_500_lines():
    folder = os.path.join(ROOT, "ep_plugin")
    if not os.path.isdir(folder):  # an installed package: the sources stay in the repository
        folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ep_plugin")
    sizes = {n: read(os.path.join(folder, n)).count("\n") for n in os.listdir(folder)
             if n.endswith((".cpp", ".h"))}
    assert sizes and not {n: c for n, c in sizes.items() if c > 500}


def test_the_session_is_thin():
    source = read(os.path.join(PACKAGE, "session.py"))
    (cls,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "OffloadSession"]
    assert cls.end_lineno - cls.lineno + 1 <= 300


def test_the_layout_check_sees_an_upward_import(tmp_path):
    """The checks read what they claim to: an upward import written into a module is
    found."""
    path = tmp_path / "m.py"
    path.write_text("from ..session import OffloadSession\nfrom ..memory.device import Device\n")
    found = list(imports(str(path), "loading.m", modules_named=True))
    assert found == [(1, "session", False), (2, "memory.device", False)]
    assert RANKS[layer("session")] > RANKS[layer("loading.m")]
