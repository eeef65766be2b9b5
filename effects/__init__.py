"""Release effects: the only bridge between a terminal transition and `kernels`.

Each module binds the plans that one family of machines in `states` names to release
effects over the pools and registry of `kernels`.
"""
