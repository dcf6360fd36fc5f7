"""memlab inside the trainers users have: :mod:`memlab.integrations.transformers` (Hugging Face
``Trainer``) and :mod:`memlab.integrations.lightning` (Lightning). Each is a thin shell over the
public API and imports its framework only when used."""
