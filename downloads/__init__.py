"""First-use downloads from the Hugging Face Hub: system prompts, PE files, the MTP head by range reads."""
