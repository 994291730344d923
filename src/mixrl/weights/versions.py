"""How many published versions are held at once: the weight store's and the broadcast sender's default."""

KEEP_VERSIONS = 2
