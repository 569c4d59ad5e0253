"""Views of a checkpoint: as the Hugging Face model directory (export) and its LoRA
adapter (lora); what consolidate and save_pretrained share."""
