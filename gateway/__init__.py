"""The gateway: the OpenAI-compatible proxy that admits turns through the scheduler.

Built so far: the prober (`gateway.prober`).  The app itself comes next."""
