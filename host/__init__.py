"""aenv host service: API, proxy, orchestrator, VMM drivers, storage, network."""
