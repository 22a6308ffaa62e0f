"""remat where users already configure training: Hugging Face's Trainer (`remat.integrations.hf`).
Each integration imports its framework only when used."""
