#!/usr/bin/env python3
"""Writes a seccomp profile that is Docker's default plus the three io_uring
syscalls, which the default profile blocks.

    # Docker's default profile ships with moby (profiles/seccomp/default.json)
    python3 add-io_uring-to-seccomp.py default.json > seccomp-io_uring.json
    docker run --security-opt seccomp=seccomp-io_uring.json ...

The alternative is to accept the thread engine: lmcache-fx detects the
blocked syscall at start and says so once.
"""

import json
import sys

IO_URING = ["io_uring_setup", "io_uring_enter", "io_uring_register"]


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    with open(sys.argv[1]) as f:
        profile = json.load(f)
    rules = profile.setdefault("syscalls", [])
    for rule in rules:  # drop any rule that denies them explicitly
        if rule.get("action") != "SCMP_ACT_ALLOW":
            rule["names"] = [n for n in rule.get("names", []) if n not in IO_URING]
    rules.append({"names": IO_URING, "action": "SCMP_ACT_ALLOW"})
    json.dump(profile, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
