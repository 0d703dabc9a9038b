"""Several models on one server: their names and folders (specs), loading on demand and
unloading when idle or when room is needed (registry), a request's model (routing)."""
