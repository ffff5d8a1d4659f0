"""splash-serve's rank-0 server: HTTP API (app, protocol), the engine thread (engine_loop), generations,
metrics, console, startup agreement between ranks, and the watchdog (see docs/architecture.md)."""
