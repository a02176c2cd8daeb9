#!/usr/bin/env python3
"""Refuse import cycles between the modules of a Rust library crate.

    scripts/check_module_cycles.py operator/src/lib.rs dataplane/src/lib.rs

For every module, its direct children must form a directed acyclic graph: child A depends
on child B when code anywhere under A names something under B (a `use` or a path such as
`crate::b::Item`). References to a module's own ancestors (`super::Item` of an item the
parent defines) are not edges: a parent and its children are one layer. Re-exports are
followed (`pub use error::{Error, Result}` in lib.rs makes `crate::Error` a reference to
`error`). Test-only code (`#[cfg(test)]` items and modules) is left out: a test may reach
anywhere.

Prints every cycle found with one reference (file:line) per edge and exits 1; prints one
line per crate and exits 0 when there is none. Needs only Python 3.

What it does not see: names brought in by a glob (`use a::*` then `Item`), macros, and
paths through a local alias (`use crate::kv as k; k::X`). The code here uses none of them
across modules; a reviewer adding one should add the plain path too.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_comments_and_strings(src: str) -> str:
    """Blank out comments, string and char literals, keeping line breaks (line numbers)."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', src[i:]):
            m = re.match(r'r(#*)"', src[i:])
            end = '"' + m.group(1)
            j = src.find(end, i + len(m.group(0)))
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            j += 1
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == "'":
            # A char literal ('a', '\n', '\u{1F600}') or a lifetime ('a).
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'", src[i:])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching_brace(src: str, open_at: int) -> int:
    depth = 0
    for j in range(open_at, len(src)):
        if src[j] == "{":
            depth += 1
        elif src[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(src) - 1


CFG_TEST = re.compile(r"#\[cfg\((test|all\(test[^\]]*|any\(test[^\]]*)\)\]")


def drop_test_items(src: str) -> str:
    """Blank out every item under `#[cfg(test)]` (a `mod`, `use`, `fn`, `impl`, ...)."""
    while True:
        m = CFG_TEST.search(src)
        if not m:
            return src
        start = m.start()
        j = m.end()
        # The item ends at its `;` or its matching `}`, whichever comes first at depth 0.
        k = j
        while k < len(src) and src[k] not in "{;":
            k += 1
        end = matching_brace(src, k) if k < len(src) and src[k] == "{" else k
        src = src[:start] + re.sub(r"[^\n]", " ", src[start : end + 1]) + src[end + 1 :]


class Module:
    def __init__(self, path: tuple[str, ...], file: Path, text: str, dir_: Path):
        self.path = path
        self.file = file
        self.text = text  # cleaned source of this module alone (children blanked)
        self.dir = dir_  # where `mod x;` files of this module live
        self.children: dict[str, Module] = {}
        self.reexports: dict[str, tuple[str, ...]] = {}  # name -> absolute path it names


def load(root_file: Path) -> Module:
    def parse(path, file, src, dir_):
        mod = Module(path, file, "", dir_)
        # Inline modules `mod x { ... }` and out-of-line `mod x;`.
        pieces = []
        pos = 0
        for m in re.finditer(rf"\b(?:pub(?:\([^)]*\))?\s+)?mod\s+({IDENT})\s*([;{{])", src):
            if m.start() < pos:
                continue
            name = m.group(1)
            if m.group(2) == "{":
                close = matching_brace(src, m.end() - 1)
                inner = src[m.end() : close]
                pad = "\n" * src.count("\n", 0, m.end())
                child = parse(path + (name,), file, pad + inner, dir_ / name)
                pieces.append(src[pos : m.start()])
                pieces.append(re.sub(r"[^\n]", " ", src[m.start() : close + 1]))
                pos = close + 1
            else:
                cands = [dir_ / f"{name}.rs", dir_ / name / "mod.rs"]
                f = next((c for c in cands if c.exists()), None)
                if f is None:
                    sys.exit(f"{file}: mod {name}: neither {cands[0]} nor {cands[1]} exists")
                child_dir = f.parent if f.name == "mod.rs" else f.with_suffix("")
                child_src = drop_test_items(strip_comments_and_strings(f.read_text()))
                child = parse(path + (name,), f, child_src, child_dir)
            mod.children[name] = child
        pieces.append(src[pos:])
        mod.text = "".join(pieces)
        return mod

    src = drop_test_items(strip_comments_and_strings(root_file.read_text()))
    return parse((), root_file, src, root_file.parent)


def all_modules(m: Module):
    yield m
    for c in m.children.values():
        yield from all_modules(c)


def expand_use_tree(tree: str) -> list[list[str]]:
    """`a::{b, c::{d, e as f}, self}` -> [[a, b], [a, c, d], [a, c, e], [a]]."""
    tree = re.sub(rf"\s+as\s+{IDENT}", "", tree)
    tree = re.sub(r"\s+", "", tree)

    def split_top(s):
        parts, depth, cur = [], 0, ""
        for ch in s:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += ch == "{"
            depth -= ch == "}"
            cur += ch
        if cur:
            parts.append(cur)
        return parts

    def go(s):
        if "{" in s:
            head, _, rest = s.partition("{")
            rest = rest[: rest.rfind("}")]
            prefix = [p for p in head.split("::") if p]
            return [prefix + tail for part in split_top(rest) for tail in go(part)]
        segs = [p for p in s.split("::") if p]
        while segs and segs[-1] in ("self", "*"):
            segs = segs[:-1]
        return [segs]

    return go(tree)


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def references(mod: Module):
    """(segments, line, is_use) for every path in the module's own code."""
    text = mod.text
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        for segs in expand_use_tree(m.group(1)):
            yield segs, line_of(text, m.start()), True
    for m in re.finditer(rf"\b((?:crate|super|self)(?:::{IDENT})+)", text):
        yield m.group(1).split("::"), line_of(text, m.start()), False


def resolve(root: Module, at: Module, segs: list[str], is_use: bool, depth=0):
    """The absolute module path a reference ends in (the longest module prefix), or None
    for a path outside the crate."""
    if not segs or depth > 8:
        return None
    if segs[0] == "crate":
        base, rest = (), segs[1:]
    elif segs[0] in ("super", "self"):
        base = at.path
        rest = list(segs)
        while rest and rest[0] in ("super", "self"):
            if rest[0] == "super":
                base = base[:-1]
            rest = rest[1:]
    elif segs[0] in at.children:
        base, rest = at.path, segs
    else:
        return None  # std, another crate, or a name in scope
    node = root
    for p in base:
        node = node.children[p]
    path = list(base)
    for s in rest:
        if s in node.children:
            node = node.children[s]
            path.append(s)
        elif s in node.reexports:
            target = node.reexports[s]
            tnode = find(root, target)
            if tnode is None:
                return tuple(target[:-1]) if find(root, target[:-1]) else tuple(path)
            node, path = tnode, list(target)
        else:
            break
    return tuple(path)


def find(root: Module, path):
    node = root
    for p in path:
        if p not in node.children:
            return None
        node = node.children[p]
    return node


def collect_reexports(root: Module):
    for mod in all_modules(root):
        for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", mod.text):
            for segs in expand_use_tree(m.group(1)):
                if not segs:
                    continue
                name = segs[-1]
                target = resolve(root, mod, segs, True)
                if target is not None and target != mod.path:
                    # Names the item's module; the item itself is the last segment.
                    mod.reexports[name] = tuple(target) + ((segs[-1],) if find(root, target + (segs[-1],)) is None else ())


def self_test():
    """The check can fail: a crate with a cycle (also one through a re-export and one
    between grandchildren) is refused, and test-only references do not count."""
    import tempfile

    cases = [
        # (files, expect a cycle)
        ({"lib.rs": "mod a;\nmod b;\n", "a.rs": "use crate::b::X;\npub struct Y;\n",
          "b.rs": "use crate::a::Y;\npub struct X;\n"}, True),
        ({"lib.rs": "mod a;\nmod b;\n", "a.rs": "use crate::b::X;\npub struct Y;\n",
          "b.rs": "#[cfg(test)]\nuse crate::a::Y;\npub struct X;\n"}, False),
        ({"lib.rs": "mod a;\nmod b;\npub use a::Y;\n", "a.rs": "use crate::b::X;\npub struct Y;\n",
          "b.rs": "pub struct X;\nfn f() -> crate::Y { todo!() }\n"}, True),
        ({"lib.rs": "mod p;\n", "p.rs": "mod c;\nmod d;\n",
          "p/c.rs": "use super::d::X; // crate::p::c -> d\npub struct Y;\n",
          "p/d.rs": "pub struct X;\nconst S: &str = \"super::c::Y\";\n"}, False),
        ({"lib.rs": "mod p;\n", "p.rs": "mod c;\nmod d;\n",
          "p/c.rs": "use super::d::X;\npub struct Y;\n",
          "p/d.rs": "use super::c::{self, Y};\npub struct X;\n"}, True),
    ]
    for i, (files, want) in enumerate(cases):
        with tempfile.TemporaryDirectory() as d:
            root = Path(d)
            for name, text in files.items():
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).write_text(text)
            got = bool(find_cycles(root / "lib.rs")[0])
            if got != want:
                sys.exit(f"self-test case {i}: cycle found = {got}, expected {want}")
    print(f"check_module_cycles self-test: {len(cases)} cases as expected")


def find_cycles(root_file: Path):
    root = load(root_file)
    collect_reexports(root)
    edges: dict[tuple, dict[tuple[str, str], str]] = defaultdict(dict)
    for mod in all_modules(root):
        for segs, line, is_use in references(mod):
            target = resolve(root, mod, segs, is_use)
            if target is None:
                continue
            src = mod.path
            k = 0
            while k < min(len(src), len(target)) and src[k] == target[k]:
                k += 1
            if k == len(src) or k == len(target):
                continue  # within one subtree, or up to an ancestor
            parent = src[:k]
            edges[parent].setdefault((src[k], target[k]), f"{mod.file}:{line}")
    cycles = []
    for parent, es in sorted(edges.items()):
        graph = defaultdict(set)
        for a, b in es:
            graph[a].add(b)
        for comp in sccs(graph):
            if len(comp) > 1:
                cycles.append((parent, comp, es))
    return cycles, root, edges


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    if argv[1] == "--self-test":
        self_test()
        argv = argv[1:]
        if len(argv) < 2:
            return 0
    failed = False
    for arg in argv[1:]:
        root_file = Path(arg)
        cycles, root, edges = find_cycles(root_file)
        name = root_file.parent.parent.name
        if not cycles:
            n = sum(len(e) for e in edges.values())
            print(f"{name}: no import cycle ({len(list(all_modules(root)))} modules, {n} edges between siblings)")
            continue
        failed = True
        for parent, comp, es in cycles:
            where = "crate" if not parent else "crate::" + "::".join(parent)
            print(f"{name}: import cycle among the children of {where}: {', '.join(sorted(comp))}")
            for (a, b), ref in sorted(es.items()):
                if a in comp and b in comp:
                    print(f"  {a} -> {b}  ({ref})")
    return 1 if failed else 0


def sccs(graph):
    """Tarjan's strongly connected components."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]
    nodes = set(graph) | {b for bs in graph.values() for b in bs}

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            out.append(comp)

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv))
