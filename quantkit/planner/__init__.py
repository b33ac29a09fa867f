"""Numbers before work: serving capacity (quantkit plan), the memory/time budgets validate and
convert run under, one GPU table, and quantkit inspect.
"""
