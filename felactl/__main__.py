from felactl.cli.main import main

main()
