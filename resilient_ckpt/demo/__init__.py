"""The main job: a real multi-process training run that loses a node and resumes bit-exactly."""
