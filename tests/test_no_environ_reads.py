"""The package reads ``EFA_EP_*`` variables only through their declarations
(:mod:`efa_ep.kernels.core.variables`: ``raw``, ``read``): no other module of it looks one up in
``os.environ`` (or any mapping) by name, so every variable the code uses is declared, typed and
in the docs' table. Writes (a launcher or probe setting a variable for its children, putting one
back) are allowed."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the folders of the package's modules (pyproject's package-dir)
PACKAGE_DIRS = ("efa_ep", "dispatcher", "kernels", "recipes", "conf")
READER = os.path.join("kernels", "core", "variables.py")


def _efa_name(node) -> bool:
    """``node`` is the literal name of a variable: ``"EFA_EP_X"`` or ``f"EFA_EP_{x}"``."""
    if isinstance(node, ast.JoinedStr) and node.values:
        node = node.values[0]
    return isinstance(node, ast.Constant) and isinstance(node.value, str) \
        and node.value.startswith("EFA_EP_")


def _names_environ(node) -> bool:
    """``node`` is ``os.environ``, ``environ`` or another name ending in ``environ``."""
    if isinstance(node, ast.Attribute):
        return node.attr.endswith("environ")
    return isinstance(node, ast.Name) and node.id.endswith("environ")


def environ_reads(source: str, filename: str = "<source>"):
    """``(line, code)`` of every read of an ``EFA_EP_*`` variable by name in ``source``:
    ``m.get("EFA_EP_X")``, ``m.setdefault("EFA_EP_X", ...)``, ``getenv("EFA_EP_X")`` and
    ``m["EFA_EP_X"]`` on any mapping ``m``, and ``"EFA_EP_X" in environ``. Not reads:
    ``m["EFA_EP_X"] = v``, ``del m["EFA_EP_X"]``, ``m.pop("EFA_EP_X", ...)``."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        hit = False
        if isinstance(node, ast.Call) and node.args and _efa_name(node.args[0]):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            hit = name in ("get", "setdefault", "getenv")
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            hit = _efa_name(node.slice)
        elif isinstance(node, ast.Compare) and _efa_name(node.left):
            hit = any(isinstance(op, (ast.In, ast.NotIn)) and _names_environ(c)
                      for op, c in zip(node.ops, node.comparators))
        if hit:
            out.append((node.lineno, ast.get_source_segment(source, node)))
    return sorted(out)


def _package_files():
    for top in PACKAGE_DIRS:
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for name in files:
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(dirpath, name), ROOT)


def test_only_the_declarations_read_efa_ep_variables():
    files = list(_package_files())
    assert READER in files and len(files) > 50
    found = []
    for rel in files:
        if rel == READER:
            continue
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            source = f.read()
        found += [f"{rel}:{line}: {code}" for line, code in environ_reads(source, rel)]
    assert found == [], (
        "EFA_EP_* read outside efa_ep.kernels.core.variables; read it with "
        "variables.raw(name) / read(name) (declare it in VARIABLES first):\n" + "\n".join(found))


def test_the_reader_module_does_read_the_environment():
    with open(os.path.join(ROOT, READER), encoding="utf-8") as f:
        assert "os.environ" in f.read()


@pytest.mark.parametrize("code", [
    'os.environ.get("EFA_EP_CACHE_DIR")',
    'os.environ.get("EFA_EP_PROXY_TAMPER", "")',
    'os.getenv("EFA_EP_FI_LIB")',
    'x = os.environ["EFA_EP_PROXY_SO"]',
    'env = os.environ\nx = env.get("EFA_EP_FI_INCLUDE")',
    'f(environ["EFA_EP_TRANSPORT"])',
    'if "EFA_EP_TRANSPORT" in os.environ: pass',
    'os.environ.setdefault("EFA_EP_CACHE_DIR", "/tmp")',
    'os.environ.get(f"EFA_EP_{name}")',
])
def test_a_read_is_found(code):
    assert len(environ_reads(code)) == 1, code


@pytest.mark.parametrize("code", [
    'os.environ["EFA_EP_CACHE_DIR"] = tmp',
    'env["EFA_EP_TRANSPORT"] = "torch"',
    'os.environ.pop("EFA_EP_CACHE_DIR", None)',
    'del os.environ["EFA_EP_CACHE_DIR"]',
    'os.environ.update({"EFA_EP_TRANSPORT": "torch"})',
    'raw("EFA_EP_PROXY_SO")',
    'x = "EFA_EP_TRANSPORT" in names',
    'os.environ.get("CC")',
])
def test_a_write_or_a_declared_read_is_not(code):
    assert environ_reads(code) == [], code
