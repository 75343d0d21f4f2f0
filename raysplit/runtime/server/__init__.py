"""What runs in the server actor: the server hosts, their components, the event loop and the step engine."""
