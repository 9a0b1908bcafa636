"""Frozen dataclasses that are JAX pytrees: the params, caches and engine states.

    @pytree.dataclass
    class Cache:
        layers: tuple
        pos: Array
        mesh: Any = pytree.static(default=None)   # aux data: part of the treedef, not a leaf

    cache.replace(pos=pos + 1)                     # a new value; the old one is unchanged

Fields are leaves (or subtrees) unless marked `static`, whose values are hashed into the treedef
(jit retraces when one changes). Our own rather than `flax.struct`: importing flax costs a
server's start-up 0.3-0.5 s (it loads flax.linen), for what the few lines below do.
"""

from __future__ import annotations

import dataclasses

import jax


def static(**kwargs):
    """A dataclass field kept in the treedef (compared and hashed), not a leaf."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


def _replace(self, **changes):
    """A copy with `changes` (a frozen dataclass is never changed in place)."""
    return dataclasses.replace(self, **changes)


def dataclass(cls):
    """`cls` as a frozen dataclass registered as a pytree (its key paths name the fields), with
    `.replace(**changes)`."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    jax.tree_util.register_dataclass(cls, data_fields=[f.name for f in fields if not f.metadata.get("static")],
                                     meta_fields=[f.name for f in fields if f.metadata.get("static")])
    cls.replace = _replace
    return cls
