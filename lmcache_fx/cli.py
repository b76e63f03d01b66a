"""`lmcache-fx` command line: a thin dispatcher; each subcommand lives in
its own module and supplies add_arguments(parser) and run(args, parser)."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "bench": ("lmcache_fx.bench", "measure lmcache-fx against fio and LMCache's own tiers"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmcache-fx")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (mod, helptext) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=helptext, description=helptext)
        importlib.import_module(mod).add_arguments(sp)
        sp.set_defaults(_module=mod, _parser=sp)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if not getattr(args, "command", None):
        p.print_help()
        return 2
    return importlib.import_module(args._module).run(args, args._parser)


if __name__ == "__main__":
    sys.exit(main())
