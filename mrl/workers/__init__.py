"""What runs inside the worker processes: a Megatron rank (actor.py). It joins megatron, bridge and
sync, so it sits above them; the driver reaches it through mrl.launch.proxies."""
