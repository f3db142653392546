"""The package's layering: every import in mtp_jax (top-level or inside a function) goes to the
module's own subpackage, a subpackage below it, or the top (config, sharding); so no import
circle exists. Importing the package imports no JAX."""

import ast
import os
import subprocess
import sys

from tests.helpers import ROOT

PACKAGE = os.path.join(ROOT, "mtp_jax")
# Lowest first: a subpackage may import the ones before it.
LAYERS = ("models", "formats", "decoding", "training", "serving", "bench")
TOP = ("config", "backend", "sharding")     # the top modules, config first


def _modules():
  for folder, _, files in os.walk(PACKAGE):
    for f in sorted(files):
      if f.endswith(".py"):
        path = os.path.join(folder, f)
        parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _imports(name: str, path: str):
  """-> the mtp_jax modules `name` imports anywhere in its source (relative imports resolved)."""
  is_pkg = path.endswith("__init__.py")
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names if a.name.startswith("mtp_jax"))
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
        mod = ".".join(base + ([node.module] if node.module else []))
      else:
        mod = node.module or ""
      if mod.startswith("mtp_jax"):
        yield mod
        yield from (f"{mod}.{a.name}" for a in node.names)


def _rank(module: str) -> int:
  """config 0, backend 1, sharding 2, LAYERS[i] i + 3: a module imports only what ranks below it, or its own
  subpackage."""
  parts = module.split(".")
  return TOP.index(parts[1]) if parts[1] in TOP else LAYERS.index(parts[1]) + len(TOP)


def test_every_import_goes_to_its_own_subpackage_or_below():
  modules = dict(_modules())
  assert len(modules) > 30
  bad = []
  for name, path in modules.items():
    if name == "mtp_jax":
      continue                    # the package's API reaches every layer, lazily
    for target in set(_imports(name, path)):
      if target not in modules or target in (name, "mtp_jax"):
        continue                  # a name inside a module, the module itself, the package
      own = _rank(name) >= len(TOP) and target.split(".")[1] == name.split(".")[1]
      if not own and _rank(target) >= _rank(name):
        bad.append(f"{name} imports {target}")
  assert not bad, "\n".join(sorted(bad))


def test_top_level_holds_at_most_four_modules():
  top = [f for f in os.listdir(PACKAGE) if f.endswith(".py")]
  assert len(top) <= 4, top


def test_importing_the_package_imports_no_jax():
  code = "import sys, mtp_jax; assert 'jax' not in sys.modules; print(mtp_jax.Decoder.__name__)"
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "Decoder"


def test_no_import_circle():
  """Inside a subpackage too: the graph of module imports (function-level ones included) is
  acyclic."""
  modules = dict(_modules())
  graph = {n: {t for t in _imports(n, p) if t in modules and t not in (n, "mtp_jax")}
           for n, p in modules.items() if n != "mtp_jax"}
  state = {}                      # 1: on the path, 2: done

  def visit(n, path):
    state[n] = 1
    for t in sorted(graph.get(n, ())):
      if state.get(t) == 1:
        raise AssertionError("import circle: " + " -> ".join(path[path.index(t):] + [t]))
      if t not in state:
        visit(t, path + [t])
    state[n] = 2

  for n in sorted(graph):
    if n not in state:
      visit(n, [n])
