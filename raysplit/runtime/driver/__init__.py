"""What runs in the driver's process: the runtime API, host calls, drivers, placement, snapshots, the local backend."""
