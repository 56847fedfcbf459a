"""No import circle in dinfer/: the imports of its modules form no cycle. A circle makes the import order decide which names exist yet, and
ties the modules on it into one that cannot be read or tested alone."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _modules(package: str) -> dict:
    """{dotted module name: its file} of every module of `package` (a folder under the repository)."""
    found = {}
    for folder, _, files in os.walk(os.path.join(REPO, package)):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), REPO)[: -len(".py")].split(os.sep)
                found[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(folder, name)
    return found


def _imports(tree: ast.Module):
    """Every import statement of a module, at its top level or deferred into a function (a deferred
    import only hides a circle until the function runs), except those under `if TYPE_CHECKING:`,
    which never run."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            todo += node.orelse
        else:
            todo += ast.iter_child_nodes(node)


def import_graph(package: str) -> dict:
    """{module: the modules of `package` it imports}: the named module and the packages above it
    that are not above the importer (those are already imported)."""
    modules = _modules(package)
    graph = {}
    for name, path in modules.items():
        is_pkg = path.endswith("__init__.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        targets = set()
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
                continue
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            targets.add(stem)
            targets |= {f"{stem}.{a.name}" for a in node.names if f"{stem}.{a.name}" in modules}
        edges = set()
        for t in targets:
            parts = t.split(".")
            for i in range(1, len(parts) + 1):
                m = ".".join(parts[:i])
                if m in modules and not (name == m or name.startswith(m + ".")):
                    edges.add(m)
        graph[name] = edges
    return graph


def find_cycle(graph: dict):
    """One cycle of `graph` as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = "done"
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_dinfer_has_no_import_cycle():
    graph = import_graph("dinfer")
    assert "dinfer.llm" in graph and "dinfer.parallel" in graph["dinfer.llm"]  # the walk sees imports
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_walk_finds_a_circle():
    # The checker itself: a circle through a package's __init__ and one through `from . import x`.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
