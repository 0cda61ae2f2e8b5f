"""The checkout's ``python -m export``: the exporter is the installed package ``dspark_export``
(console script ``dspark-export``). This folder is not installed; it only keeps the design's
command working from the project's root."""
