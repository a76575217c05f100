"""Generated gRPC stubs (built from protos/ at install time by shared/rpc/codegen.py).

Import them as `from shared.rpc.qserve.v1 import worker_pb2, worker_pb2_grpc`.
"""
