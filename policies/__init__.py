"""Pure scheduling decisions: no I/O, no asyncio, no wall clock (time comes in as ``now``).

The same objects run in the live gateway and in the virtual-time simulator.
"""
