"""Code generated from protos/pdserve/v1 (see regen.py); never edit the *_pb2* modules by hand."""
