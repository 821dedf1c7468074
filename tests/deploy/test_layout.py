"""The source's shape, checked: no module of a crate imports, through any
path, a module that imports it back. A circle between two modules means
neither can be read, tested or moved alone."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# `crate::a::b`, `super::a`, `self::a`: the paths a module names others by.
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
# `use super::{a, b::c}` and `use crate::{a, b}`: lists name several.
GROUP = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^;]*?)\};", re.S)


def crates():
    for manifest in ROOT.glob("*/Cargo.toml"):
        src = manifest.parent / "src"
        if src.is_dir():
            yield src


def module_of(src, file):
    """The module path of a source file: `http/forward.rs` is
    `["http", "forward"]`, `http/mod.rs` is `["http"]`."""
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts.pop()
    return parts


def code(file):
    """A file's code without its tests and comments: a test may use what it
    likes of its parent."""
    text = file.read_text()
    text = text.split("#[cfg(test)]", 1)[0]
    return re.sub(r"//[^\n]*", "", text)


def named(src, module, file, text):
    """Every module path `text` names, made absolute."""
    here = module if file.stem in ("mod", "lib", "main") else module[:-1]
    found = []

    def resolve(root, rest):
        rest = [p for p in rest.split("::") if p]
        if root == "crate":
            return rest
        if root == "self":
            return module + rest
        base = list(module)
        # `super` from a file module is its directory's module's parent.
        base = base[:-1]
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
        return base + rest

    for root, prefix, items in GROUP.findall(text):
        for item in re.split(r",\s*", items):
            item = item.strip().split(" as ")[0].strip()
            if item and item != "self":
                found.append(resolve(root, prefix + "::" + item.replace("{", "").replace("}", "")))
            elif item == "self":
                found.append(resolve(root, prefix))
    for root, rest in PATH.findall(text):
        found.append(resolve(root, rest))
    del here
    return found


def edges(src):
    """Module → modules it uses, each cut to the depth where the two paths
    part: `http::forward` naming `http::continuation::Hop` is an edge
    between the siblings `forward` and `continuation` of `http`."""
    files = sorted(src.rglob("*.rs"))
    modules = {tuple(module_of(src, f)) for f in files}
    graph = {}
    for file in files:
        if file.name == "tests.rs" or "tests" in file.relative_to(src).parts[:-1]:
            continue
        module = module_of(src, file)
        for target in named(src, module, file, code(file)):
            # The longest prefix that is a module: the rest are items.
            while target and tuple(target) not in modules:
                target = target[:-1]
            common = 0
            while common < min(len(module), len(target)) and module[common] == target[common]:
                common += 1
            if common == len(module) or common == len(target):
                continue  # a module using its own children or parents
            a = tuple(module[: common + 1])
            b = tuple(target[: common + 1])
            graph.setdefault(a, set()).add(b)
    return graph


def circles(graph):
    seen, stack, on_stack, found = set(), [], set(), []

    def visit(node):
        seen.add(node)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_stack:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in seen:
                visit(nxt)
        stack.pop()
        on_stack.discard(node)

    for node in sorted(graph):
        if node not in seen:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it_back():
    found = []
    for src in crates():
        for circle in circles(edges(src)):
            found.append(f"{src.parent.name}: " + " -> ".join("::".join(m) for m in circle))
    assert not found, "import circles:\n" + "\n".join(found)


def test_the_circle_finder_finds_a_circle(tmp_path):
    src = tmp_path / "src"
    (src / "http").mkdir(parents=True)
    (src / "lib.rs").write_text("mod config;\nmod http;\n")
    (src / "config.rs").write_text("use crate::http::ApiError;\n")
    (src / "http" / "mod.rs").write_text("mod a;\nmod b;\n")
    (src / "http" / "a.rs").write_text("use super::b::X;\nfn f(_: crate::config::C) {}\n")
    (src / "http" / "b.rs").write_text("use super::{a::Y, c};\n#[cfg(test)]\nmod tests { use crate::config; }\n")
    graph = edges(src)
    assert graph[("http", "a")] == {("http", "b")}
    assert graph[("http", "b")] == {("http", "a")}
    assert graph[("http",)] == {("config",)}
    assert graph[("config",)] == {("http",)}
    assert len(circles(graph)) == 2


def test_the_command_line_builds_without_the_servers_networking_etcd_or_protoc():
    """`inferyesctl` is a client of the fleet API: it needs the contracts,
    not the proxies' pool and serving loop, nor etcd's client, whose build
    needs `protoc`."""
    import subprocess

    tree = subprocess.run(
        ["cargo", "tree", "-p", "inferyes-ctl", "--prefix", "none", "-e", "normal,build", "--offline"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout
    crates = {line.split()[0] for line in tree.splitlines() if line.strip()}
    assert "inferyes-proto" in crates, tree
    for unwanted in ("etcd-client", "inferyes-net", "inferyes-controller", "inferyes-dataplane", "inferyes-agent"):
        assert unwanted not in crates, f"inferyesctl depends on {unwanted}"
