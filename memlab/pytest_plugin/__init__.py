"""memlab's pytest plugin: GPU memory budgets for tests, held on any machine (see :mod:`.plugin`).

Nothing here imports torch until a test asks to be measured.
"""
