"""The local stack's services, one module each; scripts/localstack.py is their command line.

Standard library only, for Debian's /usr/bin/python3. The modules import pgstack and mlflowstack as top-level modules:
scripts/ is on sys.path, as the folder of scripts/localstack.py when that runs, and through pytest's pythonpath.
"""
