"""remat where users already configure training (docs/integrations.md): Hugging Face's Trainer,
TRL and accelerate (`remat.integrations.hf`), Lightning's Trainer and Fabric
(`remat.integrations.lightning`), torchtitan's activation-checkpointing config
(`remat.integrations.torchtitan`). Each imports its framework only when used."""
