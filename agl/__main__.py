from agl.cli import main

main()
