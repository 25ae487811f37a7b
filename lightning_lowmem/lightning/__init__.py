"""The Lightning faces: ``Fabric(strategy="lowmem")`` (:mod:`.strategy`), the Trainer's ``LowMemCallback``
(:mod:`.callback`), the registration of ``"lowmem"`` (:mod:`.registration`), how both load (:mod:`.load`)
and the Lightning state around a model on meta (:mod:`.state`).

Importing this package does not import Lightning; importing ``.strategy`` or ``.callback`` does.
"""
