"""Varlen attention kernels behind one seam (ops layer).

`base` defines the seam, `registry` chooses a kernel by device and what is installed.
"""
