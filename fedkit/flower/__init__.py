"""fedkit on Flower: the ``flower`` executor (``flower_executor.py``), the simulation
runtime (``simulation.py``), a node's client side (``node.py``), fedkit's messages as
Flower records (``records.py``), and what a deployment runs: the apps (``serverapp.py``,
``clientapp.py``), a node's long-lived process (``runner.py``), its SuperNode
(``supernode.py``) and shorter waits inside Flower (``tuning.py``). Needs the ``flower``
extra."""
