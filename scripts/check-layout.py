#!/usr/bin/env python3
"""Checks the crate's layout, from its sources (no build):

1. every public type, trait, function and constant has exactly one public
   path (the root or its module, as ARCHITECTURE.md says), and
2. no circle among the modules: if module A names something of module B,
   B names nothing of A, directly or through others. A module naming its
   own ancestor (a store's file naming what its folder's `mod.rs` declares)
   does not count: the ancestor is its facade.

Usage: python3 scripts/check-layout.py [--graph]
Prints what it found; exits 1 on a second path or a circle.
"""
import os
import re
import sys

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
ITEM = re.compile(r"^pub (?:async )?(?:unsafe )?(struct|enum|trait|type|fn|const|static|union) (\w+)")
MOD = re.compile(r"^(pub(?:\([\w: ]+\))? )?mod (\w+);")
USE = re.compile(r"^(pub(?:\([\w: ]+\))? )?use ([^;]+);", re.S)
PATH = re.compile(r"\b((?:crate|super|self)(?:::\w+)+)")


class Module:
    def __init__(self, path, file, public):
        self.path = path  # ("backend", "redis")
        self.file = file
        self.public = public  # every module on the way is `pub`
        self.children = {}  # name -> Module
        self.items = set()  # public item names defined here
        self.uses = []  # (is_pub, full path tuple, alias)
        self.refs = set()  # module paths this one names


def module_lines(text):
    """The file's module-level lines, with `cfg_remote! { ... }` and
    `pin_project! { ... }` opened up
    and items under `#[cfg(loom)]` or `#[cfg(test)]` left out."""
    out, depth, skip_next = [], 0, False
    lines = text.split("\n")
    i = 0
    in_macro = False
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if re.match(r"^(cfg_remote|pin_project)! \{$", line):
            in_macro = True
            i += 1
            continue
        if in_macro and line == "}":
            in_macro = False
            i += 1
            continue
        level = line[4:] if in_macro and line.startswith("    ") else line
        if depth == 0 and not level.startswith((" ", "\t", "}")):
            if level.startswith(("#[cfg(loom)]", "#[cfg(test)]")):
                skip_next = True
            elif level.startswith("#[") or level.startswith("//"):
                pass
            else:
                stmt = level
                while stmt.startswith(("pub use", "use", "pub(crate) use", "pub(super) use")) and not stmt.rstrip().endswith(";"):
                    i += 1
                    stmt += " " + lines[i].strip()
                if not skip_next:
                    out.append(stmt)
                skip_next = False
        i += 1
    return out


def split_tree(spec):
    """`a::{b, c::{d, e as f}}` into [("a::b", None), ("a::c::d", None), ("a::c::e", "f")]."""
    spec = " ".join(spec.split())
    if "{" not in spec:
        name, _, alias = spec.partition(" as ")
        return [(name.strip(), alias.strip() or None)]
    head, rest = spec.split("{", 1)
    body = rest[: rest.rindex("}")]
    parts, depth, cur = [], 0, ""
    for c in body:
        depth += c == "{"
        depth -= c == "}"
        if c == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    parts.append(cur)
    out = []
    for p in (p.strip() for p in parts if p.strip()):
        for name, alias in split_tree(p):
            out.append(((head + name) if name != "self" else head.rstrip(":"), alias))
    return out


def load(path, file, public, modules):
    m = Module(path, file, public)
    modules[path] = m
    text = open(file).read()
    for line in module_lines(text):
        if mm := MOD.match(line):
            vis, name = mm.groups()
            base = os.path.dirname(file) if file.endswith(("mod.rs", "lib.rs")) else file[:-3]
            child = os.path.join(base, name + ".rs")
            if not os.path.exists(child):
                child = os.path.join(base, name, "mod.rs")
            m.children[name] = load(path + (name,), child, public and vis == "pub ", modules)
        elif mi := ITEM.match(line):
            m.items.add(mi.group(2))
        elif mu := USE.match(line):
            vis, spec = mu.groups()
            for name, alias in split_tree(spec):
                m.uses.append((vis == "pub ", name, alias))
    # What the code names; doc links and comments do not make a dependency.
    code = "\n".join(l.split("//")[0] for l in text.split("\n"))
    for p in PATH.findall(code):
        m.refs.add(p)
    return m


def absolute(m, name, modules):
    parts = name.split("::")
    if parts[0] == "crate":
        base, parts = (), parts[1:]
    elif parts[0] == "self":
        base, parts = m.path, parts[1:]
    elif parts[0] == "super":
        base = m.path
        while parts and parts[0] == "super":
            base, parts = base[:-1], parts[1:]
    elif parts[0] in m.children:
        base = m.path
    else:
        return None  # another crate
    return base + tuple(parts)


def main():
    modules = {}
    load((), os.path.join(SRC, "lib.rs"), True, modules)
    # Every public path of every item, keyed by where the item is defined.
    paths = {}
    for m in modules.values():
        if m.public:
            for item in m.items:
                paths.setdefault(m.path + (item,), set()).add("::".join(m.path + (item,)))

    def define(target, seen=()):
        """Where `target` (a full path) is defined, through re-exports."""
        mod, name = target[:-1], target[-1]
        m = modules.get(mod)
        if m is None:
            return None
        if name in m.items or name in m.children:
            return target
        for _, use, alias in m.uses:
            full = absolute(m, use, modules)
            if full and (alias or full[-1]) == name and full not in seen:
                return define(full, seen + (full,))
        return None

    for m in modules.values():
        if not m.public:
            continue
        for is_pub, use, alias in m.uses:
            full = absolute(m, use, modules)
            if not is_pub or full is None:
                continue
            home = define(full)
            if home is None or home[:-1] + (home[-1],) in modules:
                continue  # a module re-exported, or another crate's item
            paths.setdefault(home, set()).add("::".join(m.path + (alias or full[-1],)))
    twice = {k: v for k, v in paths.items() if len(v) > 1}
    for home, found in sorted(twice.items()):
        print(f"second public path: {'::'.join(home)} is reachable as {', '.join(sorted('tower_lock::' + p for p in found))}")
    print(f"public items: {len(paths)}, with more than one path: {len(twice)}")

    # The module graph: A -> B when A names an item under B.
    edges = {}
    for m in modules.values():
        names = [n for _, n, _ in m.uses] + list(m.refs)
        for n in names:
            full = absolute(m, n, modules)
            if not full:
                continue
            target = full
            while target and target not in modules:
                target = target[:-1]
            a, b = m.path, target
            if a == b or a[: len(b)] == b or b[: len(a)] == a:
                continue  # itself, an ancestor (its facade) or a descendant
            edges.setdefault(a, set()).add(b)
    circles = strongly_connected(edges)
    for c in circles:
        print("module circle: " + " <-> ".join("::".join(p) or "crate" for p in sorted(c)))
    print(f"modules: {len(modules)}, circles: {len(circles)}")
    if "--graph" in sys.argv:
        for a in sorted(edges):
            print("::".join(a) or "crate", "->", ", ".join("::".join(b) or "crate" for b in sorted(edges[a])))
    sys.exit(1 if twice or circles else 0)


def strongly_connected(edges):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    nodes = set(edges) | {b for bs in edges.values() for b in bs}

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    main()
