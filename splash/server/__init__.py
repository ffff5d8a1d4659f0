"""splash-serve's rank-0 server: HTTP API (app, protocol, body, prompts, http), the engine thread (engine_loop),
generations, metrics, console, startup agreement between ranks, and the heartbeat watchdog (see
docs/architecture.md)."""
