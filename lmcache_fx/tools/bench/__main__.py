import sys

from ..cli import console

console(["bench", *sys.argv[1:]])
