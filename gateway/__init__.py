"""The gateway: the OpenAI-compatible proxy that admits turns through the scheduler.

Built so far: the prober (`gateway.prober`), the admission shell (`gateway._shell`),
the proxy (`gateway._proxy`) and the app (`gateway.app.create_app`)."""
