"""Imports deferred to first use, as Python 3.15's `lazy import torch` does: the modules whose registries and names
the flags read (pods.py, loss_options.py, models.py, ...) load without torch and transformers, so `train.py --help` and
a mistyped flag are answered in well under a second instead of after ~10 s of imports on 2 CPU cores."""

import importlib
import sys
import types

_standing_in = []  # (a module's namespace, the LazyModule in it) for every deferred import not yet made


class LazyModule(types.ModuleType):
    """Stands in for the module of its name until an attribute is first read: that imports the module and puts it,
    in place of every stand-in of that name, into the namespaces holding one, so from then on every module holds
    the real one (a patched torch.save is seen, torch.compile sees torch, no read passes through here again)."""

    def __getattr__(self, attribute):
        module = importlib.import_module(self.__name__)
        for namespace, stand_in in list(_standing_in):
            if stand_in.__name__ == self.__name__:
                namespace.update({key: module for key, value in namespace.items() if value is stand_in})
                _standing_in.remove((namespace, stand_in))
        return getattr(module, attribute)


def lazy_module(name, namespace):
    """The module `name` for the module whose globals() are `namespace`: the module itself when it is imported
    already, else a stand-in that imports it at the first read of an attribute (torch = lazy_module("torch",
    globals()); torch.zeros(3) imports it)."""
    if name in sys.modules:
        return sys.modules[name]
    stand_in = LazyModule(name)
    _standing_in.append((namespace, stand_in))
    return stand_in
