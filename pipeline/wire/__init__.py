"""What the service API's client and server share: the signed-request scheme (`signing.py`) and the typed
messages of every route (`messages.py`). Nothing here imports a database driver, a broker or the engine."""
