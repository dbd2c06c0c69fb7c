"""Other projects' routers in front of linker workers: NVIDIA Dynamo's selection
service (``dynamo_selector`` runs in its own venv, ``dynamo_interop`` drives it)."""
