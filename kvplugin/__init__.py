"""kvplugin: memory-safe KV-cache handling for MLX LLM servers, installed from outside.

This package is imported at every interpreter start (through ``kvplugin.pth``), so it
must stay import-free: heavy modules (pluggy, pydantic, mlx) load only in a process that
imports a supported host.
"""

__version__ = "0.1.0"
