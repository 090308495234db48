"""Runs gcp-storage-emulator for tests/gcs_emulator.py, with the generation headers GCS sends.

    python tests/gcs_emulator_serve.py PORT BUCKET

GCS answers a media download with the object's generation in the
`x-goog-generation` header (and `x-goog-metageneration`); the emulator
(gcp-storage-emulator 2026.7) sends neither, and tensorstore's gcs driver,
which reads the generation there to make its next write conditional (an
OCDBT manifest is read, then rewritten on that condition), fails with
"Malformed StorageGeneration". This adds the two headers from the object's
own metadata and changes nothing else; the emulator still does not enforce
write preconditions (ifGenerationMatch), which a single writer per object,
as in these tests, never needs. Listens on 127.0.0.1 only, in memory.
"""

import sys

from gcp_storage_emulator.handlers import objects

_download = objects.download


def _download_with_generation(request, response, storage, *args, **kwargs):
  _download(request, response, storage, *args, **kwargs)
  try:
    obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
  except Exception:  # noqa: BLE001  # not found: the 404 stands
    return
  response["x-goog-generation"] = str(obj["generation"])
  response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))


objects.download = _download_with_generation  # before the server's routes bind it

from gcp_storage_emulator.server import create_server  # noqa: E402


def main() -> int:
  port, bucket = int(sys.argv[1]), sys.argv[2]
  server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
  return server.run()


if __name__ == "__main__":
  sys.exit(main())
