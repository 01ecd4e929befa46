"""Running ``flashcp pack`` and ``flashcp plan`` on an existing distributed engine (Ray), as ``--engine ray``.

The engine modules import Ray only when used; the plain install does not need it (``pip install
'flashcp[ray]'`` adds it).
"""
