"""Walks over expression graphs: each shared subexpression visited once, at any depth.

fusegen's trees share subtrees: a @fused body `y = y*y + 1` uses `y` twice, and the reverse
pass hands one gradient to several arguments. sympy's own walks (`xreplace`, `free_symbols`,
`preorder_traversal`, `atoms`, its printers, `cse`) recurse, and most follow every path, so
a graph of 20 distinct nodes can cost 2**10 visits and a deep one Python's recursion limit.
These do the same jobs with an explicit stack and a memo: linear in the distinct nodes, no
recursion, and the derivation's deadline checked as they go (limits.tick).
"""

from __future__ import annotations

import sympy

from fusegen.ir import limits


def postorder(roots) -> list:
    """Every distinct subexpression of `roots`, atoms included, children before parents,
    arguments left to right (the order a recursive walk with a visited set finishes them)."""
    seen, order = set(), []
    add, append, tick = seen.add, order.append, limits.tick
    for root in roots:
        if root in seen:
            continue
        add(root)
        stack = [(root, iter(root.args))]
        while stack:
            node, args = stack[-1]
            for a in args:
                if a not in seen:
                    add(a)
                    if a.args:
                        stack.append((a, iter(a.args)))
                        break
                    append(a)
            else:
                stack.pop()
                append(node)
                if len(order) & 255 == 0:
                    tick()
    return order


def preorder(root, seen: set | None = None):
    """Distinct subexpressions in the order sympy's preorder_traversal first meets them;
    those in `seen` (which the walk adds to) and what is below them are skipped."""
    seen = set() if seen is None else seen
    stack = [root]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        args = node.args
        if args:
            if len(seen) & 255 == 0:
                limits.tick()
            stack.extend(reversed(args))


def count(exprs) -> int:
    """Distinct operations (nodes that have arguments) of `exprs`."""
    return sum(1 for node in postorder(exprs) if node.args)


def written_size(expr, cap: int) -> int:
    """How many nodes `expr` has written out as a tree (each path counted), up to `cap`:
    `cap + 1` means more."""
    sizes: dict = {}
    for node in postorder([expr]):
        sizes[node] = min(cap + 1, 1 + sum(sizes[a] for a in node.args))
    return sizes[expr]


def free_symbols(exprs) -> set:
    """The symbols `exprs` read: sympy's free_symbols, without following every path."""
    return {node for node in postorder(exprs) if isinstance(node, sympy.Symbol)}


def substitute(exprs, rules: dict) -> list:
    """Each expression with every subexpression that is a key of `rules` replaced, as
    `xreplace` does (top down: a replaced node is not looked into; a node whose arguments
    changed is rebuilt with `func(*args)`), each shared node rebuilt once for all of them."""
    done: dict = {}
    for root in exprs:
        stack = [(root, False)]
        while stack:
            node, ready = stack.pop()
            if ready:
                args = node.args
                new = tuple(done[a] for a in args)
                done[node] = node.func(*new) if any(n is not a for n, a in zip(new, args)) else node
                continue
            if node in done:
                continue
            if node in rules:
                done[node] = rules[node]
                continue
            args = node.args
            if not args:
                done[node] = node
                continue
            if len(done) & 255 == 0:
                limits.tick()
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(args) if a not in done)
    return [done[e] for e in exprs]


def cse(exprs, symbols):
    """sympy.cse(exprs, symbols=symbols, order="none") for fusegen's trees, without recursion:
    the same temporaries, in the same order, with the same names.

    For trees of functions.py's nodes (Functions that never evaluate, and atoms), sympy's
    opt_cse finds nothing (no Add, Mul or Pow; Function.could_extract_minus_sign is False),
    so cse is tree_cse: a node met twice on the walk that does not enter repeats is a
    temporary, and the rebuild names temporaries in the order it finishes them."""
    to_eliminate, seen, excluded = set(), set(), set()
    for root in exprs:
        stack = [root]
        while stack:
            node = stack.pop()
            if not isinstance(node, sympy.Basic):
                continue
            if node.is_Atom:
                if node.is_Symbol:
                    excluded.add(node.name)
                continue
            if node in seen:
                to_eliminate.add(node)
                continue
            seen.add(node)
            if len(seen) & 255 == 0:
                limits.tick()
            stack.extend(reversed(node.args))

    names = (s for s in symbols if s.name not in excluded)
    replacements, subs, built = [], {}, {}

    def result(node):
        if not node.args:
            return node
        return subs[node] if node in subs else built[node]

    reduced = []
    for root in exprs:
        stack = [(root, False)]
        while stack:
            node, done = stack.pop()
            if not node.args:
                continue
            if done:
                new = node.func(*[result(a) for a in node.args])
                if node in to_eliminate:
                    sym = next(names)
                    subs[node] = sym
                    replacements.append((sym, new))
                else:
                    built[node] = new
                continue
            if node in subs or node in built:
                continue
            if len(built) & 255 == 0:
                limits.tick()
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(node.args) if a.args)
        reduced.append(result(root))
    return replacements, reduced
