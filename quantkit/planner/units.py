"""Byte units, one definition for the planner and the budgets: GB (10**9) for disks and files,
GiB (2**30) for memory as drivers report it."""

GB = 10**9
GiB = 2**30
